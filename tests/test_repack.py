"""The CPU backend's Q5_0 -> Q8_0 repack: the same values, counted in the memory plan, and the
stored pages handed back only where they are file-backed."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_kernels import reference, rel_err

from ubatch.kernels.cpu.build import FAST_FLAGS, cpu_flags
from ubatch.kernels.cpu.ops import CpuOps
from ubatch.kernels.quant.dequant import dequantize
from ubatch.kernels.quant.repack import Repacks, q5_0_to_q8_0, releasable, release_pages
from ubatch.kernels.quant.weight import QWeight

needs_avx2 = pytest.mark.skipif(not set(FAST_FLAGS) <= cpu_flags(), reason="the repack is for the AVX2 kernels")


def _q5_0_blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, 22), dtype=torch.uint8, generator=g)
    d = (torch.randn(n, generator=g) * 0.01).to(torch.float16)  # finite scales, random bits elsewhere
    b[:, :2] = d.view(torch.uint8).view(n, 2)
    b[0, 2:] = 0  # every fifth bit clear, every nibble 0: all values -16 d
    b[1, 2:] = 255  # all set: +15 d
    return b.view(-1)


def test_q5_0_as_q8_0_holds_the_same_values_bit_for_bit() -> None:
    raw = _q5_0_blocks(4096)
    packed = q5_0_to_q8_0(raw)
    assert packed.numel() == 4096 * 34
    a, b = dequantize(raw, T.Q5_0, (64, 64 * 32)), dequantize(packed, T.Q8_0, (64, 64 * 32))
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    d = raw.view(-1, 22)[:2, :2].contiguous().view(torch.float16).float().view(2)
    assert torch.equal(a[0, :32], (-16 * d[0]).expand(32)) and torch.equal(a[0, 32:64], (15 * d[1]).expand(32))


def test_only_file_backed_pages_are_released_and_they_read_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = np.random.default_rng(1).integers(0, 256, 8 * mmap.PAGESIZE + 100, dtype=np.uint8)
    f = tmp_path / "blob.bin"
    f.write_bytes(data.tobytes())
    with f.open("rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    view = torch.from_numpy(np.frombuffer(mm, np.uint8)[50:])  # starts mid-page: that page is kept
    want = releasable(view)
    assert want == 7 * mmap.PAGESIZE
    assert release_pages(view) == want
    assert torch.equal(view, torch.from_numpy(data[50:]))  # re-read from the file
    anon = torch.arange(8 * mmap.PAGESIZE, dtype=torch.int32).to(torch.uint8)
    assert releasable(anon) == 0 and release_pages(anon) == 0  # anonymous memory would be lost
    assert torch.equal(anon, torch.arange(8 * mmap.PAGESIZE, dtype=torch.int32).to(torch.uint8))


def test_repacks_are_made_at_first_use_and_counted_before() -> None:
    w = QWeight("w", _q5_0_blocks(24 * 8), int(T.Q5_0), (24, 8 * 32))
    off, on = Repacks(False), Repacks(True)
    for r in (off, on):
        r.plan([w, QWeight("q8", torch.zeros(34 * 8, dtype=torch.uint8), int(T.Q8_0), (1, 256))])
    assert off.held_bytes() == 0 and off.layout(w) is w and off.describe(T.Q5_0) == ""
    assert on.kernel_type(w) == T.Q8_0 and on.held_bytes() == 24 * 8 * 34  # anonymous: nothing released
    assert not on._made  # planning alone repacks nothing (`ubatch info`)
    assert on.extra_bytes() == 24 * 8 * 12 and off.extra_bytes() == 0  # read a token beyond the stored bytes
    p = on.layout(w)
    assert p is on.layout(w) and p.ggml_type == T.Q8_0 and on.held_bytes() == 24 * 8 * 34
    assert "repacked to Q8_0" in on.describe(T.Q5_0) and on.describe(T.Q8_0) == ""
    again = Repacks(True)  # another context of the same weights shares the repack
    again.plan([w])
    assert again.layout(w) is p and again.held_bytes() == on.held_bytes()


@needs_avx2
def test_the_avx2_backend_computes_q5_0_from_its_repack(default_model) -> None:  # type: ignore[no-untyped-def]
    ops = CpuOps(2, no_avx512=True)
    q5 = [w for w in default_model.matrices() if w.ggml_type == T.Q5_0]
    ops.prepare_weights(default_model.matrices())
    stored = sum(w.nbytes for w in q5)
    freed = sum(releasable(w.raw) for w in q5)
    assert freed > 0.99 * stored  # the file's pages: all but the partial ones at the ends
    assert ops.held_bytes() == stored // 22 * 34 - freed
    assert ops.kernel_path(T.Q5_0).startswith("repacked to Q8_0") and "repacked" not in ops.kernel_path(T.Q4_K)
    w = q5[0]
    x = torch.randn(3, w.shape[1])
    want = reference(ops, w, x)  # x as the AVX2 build reads it (16-bit integers)
    got = ops.linear(x, w, torch.empty(3, w.shape[0]))
    assert ops.kernels.repacks.layout(w).ggml_type == T.Q8_0  # made by that call
    assert rel_err(got, want) <= 1e-5
    assert ops.kernels.gemv_scratch(1, w) == ops.kernels.gemv_scratch(1, ops.kernels.repacks.layout(w))
    assert torch.equal(
        dequantize(w.raw, T.Q5_0, w.shape), dequantize(ops.kernels.repacks.layout(w).raw, T.Q8_0, w.shape)
    )
