"""Hugging Face checkpoints: `-m DIR` runs a safetensors + tokenizer.model directory, and
`ubatch convert` writes the GGUF file that runs identically.

The checkpoints are tiny and written here (tests/tiny_hf.py): random weights, a SentencePiece
model trained on generated text. An independent Hugging Face-style forward pass (rotate-half
RoPE on the unpermuted weights) checks the Q/K permutation; the converted files must give the
checkpoint's logits exactly (same dtype) or closely (q8_0).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_cli import assert_user_error, ubatch, ubatch_inproc
from tiny_hf import HFSpec, corpus, write_tiny_hf

from ubatch.engine.batch import Batch
from ubatch.engine.completion.complete import complete
from ubatch.engine.context.context import Context
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.gguf.file import open_gguf
from ubatch.engine.model.hf.convert import as_f32, convert
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams

IDS = [1, 45, 120, 7, 300, 33, 250, 99, 12, 180, 64, 5]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    specs = {
        "f16": HFSpec(),
        "bf16": HFSpec(dtype=torch.bfloat16, shards=2, tied=True, seed=1),
        "f32": HFSpec(dtype=torch.float32, seed=2),
        "gemma3": HFSpec(arch="gemma3", dtype=torch.bfloat16, seed=3),
        "gemma3-mm": HFSpec(arch="gemma3", dtype=torch.bfloat16, seed=3, multimodal=True),
    }
    return {k: write_tiny_hf(root / k, s) for k, s in specs.items()}


def logits(path: Path) -> torch.Tensor:
    ctx = Context(Model.load(path), ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    ctx.decode(Batch.from_tokens(IDS, 0, all_logits=True))
    return ctx.logits.clone()


def hf_logits(d: Path, ids: list[int]) -> torch.Tensor:
    """transformers' LlamaForCausalLM / Gemma3ForCausalLM forward in plain torch, from the HF
    tensors as stored: rotate-half RoPE without the permutation, gemma3's (1 + w) norms."""
    cfg = json.loads((d / "config.json").read_text())
    w = {}
    for f in sorted(d.glob("*.safetensors")):
        w |= {k: v.float() for k, v in load_file(str(f)).items()}
    gemma = cfg["model_type"] == "gemma3_text"
    nh, nkv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    n = len(ids)

    def norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + g if gemma else g)

    def rope(x: torch.Tensor, base: float) -> torch.Tensor:  # (n, heads, hd)
        ang = torch.arange(n).double()[:, None] * base ** (-torch.arange(0, hd, 2).double() / hd)[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1).float()[:, None], torch.cat([ang.sin()] * 2, -1).float()[:, None]
        return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin

    x = w["model.embed_tokens.weight"][ids] * (math.sqrt(cfg["hidden_size"]) if gemma else 1.0)
    i = torch.arange(n)
    mask = torch.where(i[None] > i[:, None], -math.inf, 0.0)
    if gemma:  # every layer of 2 is a sliding-window layer (pattern 6)
        mask = mask.masked_fill(i[:, None] - i[None] >= cfg["sliding_window"], -math.inf)
    base = cfg["rope_local_base_freq"] if gemma else cfg["rope_theta"]
    scale = cfg["query_pre_attn_scalar"] ** -0.5 if gemma else hd**-0.5
    for il in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{il}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, nh, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, nkv, hd)
        if gemma:
            q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q, base), rope(k, base).repeat_interleave(nh // nkv, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, nkv, hd).repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * scale + mask, -1)
        a = torch.einsum("hqk,khd->qhd", att, v).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = x + (norm(a, w[p + "post_attention_layernorm.weight"]) if gemma else a)
        h = norm(x, w[p + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm") + ".weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        act = torch.nn.functional.gelu(gate, approximate="tanh") if gemma else torch.nn.functional.silu(gate)
        f = (act * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        x = x + (norm(f, w[p + "post_feedforward_layernorm.weight"]) if gemma else f)
    out = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return norm(x, w["model.norm.weight"]) @ out.T


@pytest.mark.parametrize("kind", ["f16", "bf16", "f32", "gemma3"])
def test_checkpoint_matches_hugging_face_forward(ckpts: dict[str, Path], kind: str) -> None:
    """The engine on the directory computes what transformers would: the Q/K permutation and
    gemma3's norm shift are right."""
    ours = logits(ckpts[kind])
    ref = hf_logits(ckpts[kind], IDS)
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", ["f16", "bf16", "f32", "gemma3"])
def test_converted_gguf_gives_the_same_logits(ckpts: dict[str, Path], tmp_path: Path, kind: str) -> None:
    d = ckpts[kind]
    outtype = {"gemma3": "bf16"}.get(kind, kind)
    f = convert(d, tmp_path / "m.gguf", outtype)
    g = open_gguf(f)
    m = Model.load(d)
    assert g.metadata["general.file_type"] == m.gguf.metadata["general.file_type"]
    assert {n: (t.ggml_type, t.shape) for n, t in g.tensors.items()} == {
        n: (t.ggml_type, t.shape) for n, t in m.gguf.tensors.items()
    }
    assert m.size_bytes == sum(t.n_bytes for t in g.tensors.values())
    assert torch.equal(logits(d), logits(f))


@pytest.mark.parametrize("kind", ["f16", "gemma3"])
def test_q8_0_conversion(ckpts: dict[str, Path], tmp_path: Path, kind: str) -> None:
    """q8_0 blocks are ggml's (gguf-py's reference quantiser), norms stay f32, logits stay close."""
    d = ckpts[kind]
    g = open_gguf(convert(d, tmp_path / "q8.gguf", "q8_0"))
    src = Model.load(d).gguf.tensors
    for name, t in g.tensors.items():
        if len(t.shape) == 1:
            assert t.ggml_type == gguf.GGMLQuantizationType.F32
            assert np.array_equal(t.data, src[name].data)
        else:
            assert t.ggml_type == gguf.GGMLQuantizationType.Q8_0, name
            ref = gguf.quants.quantize(as_f32(src[name]), gguf.GGMLQuantizationType.Q8_0)
            assert np.array_equal(t.data, ref.reshape(-1)), name
    a, b = logits(d), logits(g.path)
    assert not torch.equal(a, b)
    err = ((b - a).norm() / a.norm()).item()  # 0.036 (llama) on these random weights; bf16 gives 0.011
    assert err < 0.08, err


def test_gemma3_conditional_generation_runs_its_text_model(ckpts: dict[str, Path]) -> None:
    """A Gemma3ForConditionalGeneration checkpoint: text_config read, vision tensors skipped."""
    assert torch.equal(logits(ckpts["gemma3-mm"]), logits(ckpts["gemma3"]))


def test_greedy_tokens_from_directory_and_converted_file(ckpts: dict[str, Path], tmp_path: Path) -> None:
    f = convert(ckpts["bf16"], tmp_path / "m.gguf", "bf16")

    def greedy(path: Path) -> list[int]:
        ctx = Context(Model.load(path), ContextParams(n_ctx=256))
        return [
            e.token
            for e in complete(
                ctx, IDS[:4], Sampler(SamplerParams(temp=0)), GenerationParams(n_predict=24, ignore_eos=True)
            )
        ]

    toks = greedy(ckpts["bf16"])
    assert len(toks) == 24 and len(set(toks)) > 3
    assert greedy(f) == toks


def test_sentencepiece_and_engine_vocab_agree(ckpts: dict[str, Path]) -> None:
    import sentencepiece as spm

    d = ckpts["f16"]
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    vocab = Model.load(d).vocab
    assert (vocab.bos, vocab.eos, vocab.unk, vocab.add_bos) == (sp.bos_id(), sp.eos_id(), sp.unk_id(), True)
    texts = corpus(300, seed=5) + ["", " ", "  two  spaces", "tab\there", "new\nline", "ünïcödé 日本語 🙂", "12345"]
    for t in texts:
        assert vocab.tokenize(t, False, False) == sp.encode(t), t
    assert vocab.tokenize("the cat", True, False) == [sp.bos_id(), *sp.encode("the cat")]


def test_cli_runs_a_checkpoint_and_converts_it(ckpts: dict[str, Path], tmp_path: Path) -> None:
    d, f = ckpts["f16"], tmp_path / "m.gguf"
    conv = ubatch("convert", d, "-o", f, "--outtype", "f16")
    assert conv.returncode == 0 and f.is_file(), conv.stderr
    a = ubatch("cli", "-m", d, "-p", "the cat", "-n", "12", "--temp", "0", "--ignore-eos")
    b = ubatch("cli", "-m", f, "-p", "the cat", "-n", "12", "--temp", "0", "--ignore-eos")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.startswith("the cat")
    size = Model.load(d).size_bytes
    assert f"loaded {d.name}: {d.name} (llama), " in a.stderr
    assert f"params, {size / 2**20:.2f} MiB, 16.0" in a.stderr  # the tensor bytes read, f16: 16.x BPW
    import sentencepiece as spm

    tok = ubatch_inproc({"t": ["tokenize", "-m", d, "-p", "the cat", "--ids"]})["t"]
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    assert tok.stdout.strip() == str([sp.bos_id(), *sp.encode("the cat")]), tok.stderr


def _broken(root: Path, name: str, spec: HFSpec, edit) -> Path:  # type: ignore[no-untyped-def]
    d = write_tiny_hf(root / name, spec)
    edit(d)
    return d


def test_bad_checkpoints_are_one_line(tmp_path: Path) -> None:
    def cfg(d: Path, **kw: object) -> None:
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(c | kw))

    def drop(d: Path, name: str) -> None:
        from safetensors.torch import save_file

        t = load_file(str(d / "model.safetensors"))
        del t[name]
        save_file(t, str(d / "model.safetensors"))

    one, two = HFSpec(), HFSpec(shards=2)
    cases = {
        "no config": (one, lambda d: (d / "config.json").unlink(), "no config.json"),
        "model_type": (one, lambda d: cfg(d, model_type="gpt2"), "model_type 'gpt2' is not supported"),
        "shard missing": (two, lambda d: (d / "model-00002-of-00002.safetensors").unlink(), "model-00002-of-00002"),
        "tensor missing": (one, lambda d: drop(d, "model.layers.1.mlp.up_proj.weight"), "blk.1.ffn_up.weight"),
        "shape": (one, lambda d: cfg(d, intermediate_size=128), "but config.json implies"),
        "no tokenizer": (one, lambda d: (d / "tokenizer.model").unlink(), "neither tokenizer.model nor tokenizer.json"),
        "bad tokenizer.json": (one, lambda d: _bpe_only(d, "{not json"), "tokenizer.json: not valid JSON"),
        "unknown pre": (one, lambda d: _bpe_only(d, None), "pre-tokenizer is not one llama.cpp knows"),
    }
    dirs = {k: _broken(tmp_path, k.replace(" ", "_"), spec, edit) for k, (spec, edit, _) in cases.items()}
    runs = ubatch_inproc({k: ["cli", "-m", d, "-p", "x", "-n", "1"] for k, d in dirs.items()})
    for k, (_, _, needle) in cases.items():
        assert_user_error(runs[k], needle)
    conv = ubatch_inproc({"outtype": ["convert", dirs["shape"], "-o", tmp_path / "x.gguf", "--outtype", "q4_k"]})
    assert_user_error(conv["outtype"], "--outtype")
    assert not (tmp_path / "x.gguf").exists()


def _bpe_only(d: Path, text: str | None) -> None:
    """tokenizer.model replaced by a tokenizer.json: `text`, or a small BPE of its own whose
    check-text hash no converter knows."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    (d / "tokenizer.model").unlink()
    if text is not None:
        (d / "tokenizer.json").write_text(text)
        return
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdefgh")}, merges=[], unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))


@pytest.mark.parametrize("name", ["gpt-2", "llama-bpe", "qwen2"])
def test_a_tokenizer_json_reads_as_the_converter_reads_it(tmp_path: Path, name: str) -> None:
    """A real BPE tokenizer (llama.cpp's test vocabulary as tokenizer.json): every token and type
    as the vocabulary holds them, and the pre-tokenizer named by the converter's hash of the ids
    the tokenizers library gives for its check text (Llama 3's starts with its BOS)."""
    import tiny_bpe
    import tiny_families

    from ubatch.engine.model.hf.tokenizer import bpe_tables

    src = tiny_families.llama_cpp_src()
    if src is None:
        pytest.skip("llama.cpp's test vocabularies are not available (../shared/tools/llama-cpp.sh)")
    tokens, types = tiny_bpe.write_tokenizer_json(tmp_path, src, name)
    got_tokens, got_types, pre = bpe_tables(tmp_path, len(tokens))
    assert pre == name and got_tokens == tokens
    # ids past the tokenizer's own are [PAD] placeholders: UNUSED today, USER_DEFINED in older files
    held = [i for i, t in enumerate(tokens) if t != f"[PAD{i}]"]
    assert [got_types[i] for i in held] == [types[i] for i in held]


def test_a_bpe_checkpoint_directory_runs_as_its_conversion(tmp_path: Path) -> None:
    """-m DIR on a qwen2 checkpoint whose only tokenizer is tokenizer.json (Qwen 2's vocabulary):
    the tokenizer keys equal those llama.cpp's converter writes from the same directory, and
    `ubatch tokenize` gives the same ids for the directory and for that file."""
    import tiny_bpe
    import tiny_families

    src = tiny_families.llama_cpp_src()
    if src is None:
        pytest.skip("llama.cpp's converter is not available (../shared/tools/llama-cpp.sh)")
    d = tiny_bpe.write_qwen2_checkpoint(tmp_path / "qwen2-bpe", src)
    gguf_file = tiny_families.convert_llama_cpp(d, tmp_path / "qwen2-bpe.gguf", own_vocab=True)
    ours, theirs = open_checkpoint_meta(d), open_gguf(gguf_file).metadata
    keys = [k for k in theirs if k.startswith("tokenizer.") and k != "tokenizer.chat_template"]
    assert "tokenizer.ggml.merges" in keys and theirs["tokenizer.ggml.pre"] == "qwen2"
    for k in keys:
        a, b = ours.get(k), theirs[k]
        assert a == b if isinstance(b, (str, int, float, bool)) else list(a) == list(b), k  # type: ignore[call-overload]
    text = "Hello world! 3333 tokens,\n\tnew   lines 😁 and 'quotes'"
    ids = [ubatch("tokenize", "-m", str(p), "-p", text, "--ids").stdout for p in (d, gguf_file)]
    assert ids[0] == ids[1] and ids[0].strip().startswith("[")


def open_checkpoint_meta(d: Path) -> dict[str, object]:
    from ubatch.engine.model.hf.checkpoint import open_checkpoint

    return dict(open_checkpoint(d)[0].metadata)
