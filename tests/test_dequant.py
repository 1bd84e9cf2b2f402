"""Dequantisation is bit-exact against gguf-py's numpy reference (itself checked against ggml C)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as ref_dequantize

import ubatch.kernels.quant.dequant as dq
from ubatch.kernels.quant.dequant import SUPPORTED_TYPES, UnsupportedTypeError, check_supported, dequantize, type_name

# byte offsets of the f16 fields (d, dmin / m) inside one block, per quantised type
F16_FIELDS = {
    T.Q8_0: (0,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.MXFP4: (),  # an E8M0 byte: every value is a power of two (2^128 * 6 overflows to inf, as in ggml)
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.IQ3_S: (0,),
    T.IQ3_XXS: (0,),
    T.IQ2_XXS: (0,),
    T.IQ2_XS: (0,),
    T.IQ2_S: (0,),
    T.IQ1_S: (0,),
    T.IQ1_M: (),  # its f16 scale is spread over the top nibbles of four u16 (random: NaN/inf included)
    T.TQ1_0: (52,),
    T.TQ2_0: (64,),
}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_rows(t: T, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """(rows, row_bytes) random blocks with finite scales (f16 fields in +-0.05; no NaN/Inf)."""
    rng = np.random.default_rng(seed + int(t))
    _, type_size = GGML_QUANT_SIZES[t]
    blocks = rng.integers(0, 256, (rows * blocks_per_row, type_size), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        vals = rng.uniform(-0.05, 0.05, (len(blocks), 1)).astype(np.float16)
        blocks[:, off : off + 2] = vals.view(np.uint8)
    if t == T.MXFP4:  # E8M0 scales 2^-9 .. 2^0
        blocks[:, 0] = rng.integers(118, 128, len(blocks))
    if t == T.IQ1_M:  # its f16 scale's top exponent bit (bit 6 of byte 55) clear: finite, below 2
        blocks[:, 55] &= 0xBF
    return blocks.reshape(rows, blocks_per_row * type_size)


def assert_bits_equal(got: torch.Tensor, want: np.ndarray) -> None:
    """Bit-for-bit equality (stronger than ==: distinguishes -0.0 and compares NaN payloads)."""
    assert got.dtype == torch.float32
    g = got.cpu().numpy()
    assert g.shape == want.shape
    bad = np.flatnonzero(g.view(np.int32) != want.view(np.int32))
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{bad.size} mismatches, first at {i}: {g.flat[i]} vs {want.flat[i]}")


def test_supported_types() -> None:
    names = {type_name(t) for t in SUPPORTED_TYPES}
    assert names == {
        "F32",
        "F16",
        "BF16",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "MXFP4",
        "IQ4_NL",
        "IQ4_XS",
        "IQ3_S",
        "IQ3_XXS",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ1_S",
        "IQ1_M",
        "TQ1_0",
        "TQ2_0",
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t", list(F16_FIELDS), ids=lambda t: t.name)
def test_random_blocks_bit_exact(t: T, device: str) -> None:
    block, _ = GGML_QUANT_SIZES[t]
    rows, bpr = 7, 48 if block == 32 else 9  # 336 / 63 blocks, several rows
    raw = random_rows(t, rows, bpr)
    got = dequantize(torch.from_numpy(raw).to(device), t, (rows, bpr * block))
    assert got.device.type == device
    assert_bits_equal(got, ref_dequantize(raw, t))


@pytest.mark.parametrize("t", list(F16_FIELDS), ids=lambda t: t.name)
def test_chunking_dtype_and_3d_shape(t: T, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks that are not a multiple of a row, a bf16 result, a 3-D shape and an odd byte start."""
    monkeypatch.setattr(dq, "CHUNK_ELEMENTS", 1000)
    block, _ = GGML_QUANT_SIZES[t]
    raw = random_rows(t, 6, 5, seed=1)
    want = ref_dequantize(raw, t).reshape(2, 3, 5 * block)
    padded = torch.from_numpy(np.concatenate([[7], raw.ravel()]).astype(np.uint8))
    got = dequantize(padded[1:], t, (2, 3, 5 * block))  # storage offset 1: unaligned f16 fields
    assert_bits_equal(got, want)
    got16 = dequantize(torch.from_numpy(raw), t, (2, 3, 5 * block), dtype=torch.bfloat16)
    assert got16.dtype == torch.bfloat16
    assert torch.equal(got16, torch.from_numpy(want).to(torch.bfloat16))


@pytest.mark.parametrize("t", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types(t: T) -> None:
    rng = np.random.default_rng(3)
    vals = rng.standard_normal((5, 64)).astype(np.float32)
    if t == T.F32:
        raw = vals.view(np.uint8)
    elif t == T.F16:
        raw = vals.astype(np.float16).view(np.uint8)
    else:  # every bf16 bit pattern class: random u16 including NaN/Inf/denormals
        raw = rng.integers(0, 1 << 16, (5, 64), dtype=np.uint16).view(np.uint8)
    want = ref_dequantize(raw, t)
    got = dequantize(torch.from_numpy(raw.copy()), t, (5, 64))
    assert_bits_equal(got, want)
    odd = torch.from_numpy(np.concatenate([[0], raw.ravel()]).astype(np.uint8))[1:]
    assert_bits_equal(dequantize(odd, t, (5, 64)), want)
    if t == T.BF16:  # spec: f32 bits = u16 << 16
        u16 = raw.view(np.uint16).astype(np.uint32) << 16
        assert np.array_equal(got.numpy().view(np.uint32), u16)


def test_unsupported_type_raises() -> None:
    raw = torch.zeros(66, dtype=torch.uint8)
    with pytest.raises(UnsupportedTypeError, match=r"NVFP4 \(id 40\) is not supported; supported: F32"):
        dequantize(raw, T.NVFP4, (1, 64))
    with pytest.raises(UnsupportedTypeError, match=r"blk\.0\.attn_q\.weight: .*Q8_1"):
        check_supported(T.Q8_1, "blk.0.attn_q.weight")
    with pytest.raises(UnsupportedTypeError, match=r"unknown \(id 99\)"):
        check_supported(99, "x")
    check_supported(T.Q4_K, "fine")


def test_wrong_byte_count_raises() -> None:
    with pytest.raises(ValueError, match="needs 34 bytes"):
        dequantize(torch.zeros(35, dtype=torch.uint8), T.Q8_0, (1, 32))


# ---------------------------------------------------------------- real tensors of the 270M model


@pytest.fixture(scope="module")
def gguf_270m(default_model_path):
    from ubatch.engine.gguf.file import open_gguf

    return open_gguf(default_model_path)


def _check_tensor(g, name: str, rows: int | None = None) -> np.ndarray:
    """Dequantise `name` (optionally only its first `rows` rows) both ways; assert bit-equality."""
    ti = g.tensors[name]
    shape = ti.shape if rows is None else (rows, *ti.shape[1:])
    n_bytes = ti.n_bytes * int(np.prod(shape)) // int(np.prod(ti.shape))
    raw = np.array(ti.data[:n_bytes])  # copy: the memmap is read-only
    want = ref_dequantize(raw.reshape(-1, n_bytes // int(np.prod(shape[:-1]))), T(ti.ggml_type))
    want = want.reshape(shape)
    got = dequantize(torch.from_numpy(raw), ti.ggml_type, shape)
    assert_bits_equal(got, want)
    return want


@pytest.mark.slow
def test_model_one_tensor_per_type(gguf_270m) -> None:
    g = gguf_270m
    first: dict[int, str] = {}
    for name, ti in g.tensors.items():
        if name != "token_embd.weight":
            first.setdefault(ti.ggml_type, name)
    assert {T(t).name for t in first} == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    for name in first.values():
        _check_tensor(g, name)
    emb = _check_tensor(g, "token_embd.weight", rows=4096)
    np.testing.assert_allclose(emb[2, :4], [-0.014242, 0.010567, 0.013324, 0.012405], atol=1e-6)
    assert abs(float(np.linalg.norm(emb[2].astype(np.float64))) - 1.0316) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, mean, std, amax, first4",
    [
        ("blk.0.ffn_down.weight", 4.943995e-06, 2.158547e-02, 0.738770, [0.005212, 0.021715, -0.025190, 0.013898]),
        ("blk.2.ffn_down.weight", 2.333824e-06, 1.631285e-02, 0.377395, [-0.016777, -0.004513, -0.004513, -0.020865]),
        ("blk.0.attn_output.weight", -2.797052e-06, 3.767657e-02, 0.547462, None),
        ("blk.0.attn_q.weight", -7.887782e-05, 3.955150e-02, 0.859375, [-0.003784, 0.007568, -0.015137, -0.005676]),
        ("blk.0.attn_v.weight", 9.487837e-06, 3.952997e-02, 0.271544, None),
    ],
)
def test_model_statistics_match_spec(gguf_270m, name, mean, std, amax, first4) -> None:
    """The float64 statistics of gguf-models.md §7 (independent of gguf-py)."""
    ti = gguf_270m.tensors[name]
    a = dequantize(torch.from_numpy(np.array(ti.data)), ti.ggml_type, ti.shape).double()
    assert a.mean().item() == pytest.approx(mean, rel=1e-5, abs=1e-11)
    assert a.std(correction=0).item() == pytest.approx(std, rel=1e-5)
    assert a.abs().max().item() == pytest.approx(amax, rel=1e-5)
    if first4 is not None:
        np.testing.assert_allclose(a[0, :4].numpy(), first4, atol=1e-6)
    if name == "blk.0.ffn_down.weight":
        assert a[1, 0].item() == pytest.approx(-0.003342, abs=1e-6)
