"""Each architecture's tiny checkpoint as llama.cpp and ubatch run it, against transformers' fp32.

    python scripts/family_fidelity.py [--families qwen3,qwen2] [-n 128] [--types F32,F16,Q8_0,Q4_K_M]
    python scripts/family_fidelity.py --families qwen3moe

For every family of tests/tiny_families.py (the dense ones by default; MoE ones by name): the seeded random checkpoint, converted to F32 and F16
by llama.cpp's convert_hf_to_gguf.py and quantised to Q8_0 and Q4_K_M by its llama-quantize; the
next-token distribution at each of n positions of a fixed id sequence from transformers' fp32
forward (the reference), from ubatch (cpu backend, f32 KV cache, teacher-forced in one ubatch)
and from llama-server (f32 KV cache too; the whole distribution, `n_probs` = the vocabulary,
one request per position with its prompt cache). Prints per family and file type the mean KLD and top-1 agreement
against the reference for both, and ubatch's KLD against llama.cpp's on the same file.
Needs ../shared/tools/llama-cpp.sh's build (llama-quantize, llama-server) and its source folder.
"""

from __future__ import annotations

import argparse
import math
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import tiny_families  # noqa: E402

BIN = Path.home() / ".cache/ubatch-yardstick/build/bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gguf_of(d: Path, work: Path, family: str, qtype: str) -> Path:
    """The family's file in qtype: F32/F16 from the converter, the others from llama-quantize."""
    if qtype in ("F32", "F16"):
        return with_q_lora_key(tiny_families.convert_llama_cpp(d, work / f"{family}.{qtype}.gguf", qtype.lower()))
    out = work / f"{family}.{qtype}.gguf"
    if not out.exists():
        src = tiny_families.convert_llama_cpp(d, work / f"{family}.F32.gguf", "f32")
        extra = ["--imatrix", str(uniform_imatrix(src))] if qtype.startswith(("IQ1", "IQ2", "IQ3_XXS")) else []
        r = subprocess.run(
            [str(BIN / "llama-quantize"), *extra, str(src), str(out), qtype], capture_output=True, text=True
        )
        if r.returncode:
            raise SystemExit(f"llama-quantize {qtype} failed: {r.stderr[-2000:]}")
    return out


def with_q_lora_key(path: Path) -> Path:
    """A deepseek2 file without q (V2-Lite's shape) as llama.cpp loads it: its loader requires
    attention.q_lora_rank unless the model has V2-Lite's 26 or 27 layers, and 0 means none
    (the converter writes the key only where the checkpoint has a q_lora_rank). Rewritten in
    place with the key added; other files are left as they are."""
    import gguf

    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    if arch != "deepseek2" or "deepseek2.attention.q_lora_rank" in r.fields:
        return path
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(tmp, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub)
    w.add_uint32("deepseek2.attention.q_lora_rank", 0)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


def uniform_imatrix(src: Path) -> Path:
    """An importance matrix of ones for every matrix of src, in llama.cpp's legacy binary format
    (entries: name, ncall, the row length's values; no llama-imatrix needed): llama-quantize wants
    one for the 1-, 2- and IQ3_XXS types, and ones weigh every column alike."""
    import struct

    from ubatch.engine.gguf.file import open_gguf

    mats = [(name, t.shape[-1]) for name, t in open_gguf(src).tensors.items() if len(t.shape) == 2]
    out = src.with_suffix(".imatrix.dat")
    with out.open("wb") as f:
        f.write(struct.pack("<i", len(mats)))
        for name, n in mats:
            f.write(struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 1, n))
            f.write(struct.pack(f"<{n}f", *([1.0] * n)))
    return out


def ubatch_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    from ubatch.engine.batch import Batch
    from ubatch.engine.context.context import Context
    from ubatch.engine.model.model import Model
    from ubatch.engine.params import ContextParams

    params = ContextParams(n_ctx=1024, n_ubatch=512, type_k="f32", type_v="f32", backend="cpu", n_threads=2)
    ctx = Context(Model.load(path), params)
    ctx.decode(Batch.from_tokens(ids, 0, all_logits=True))
    return torch.log_softmax(ctx.logits.double(), -1)


def llama_cpp_logprobs(path: Path, ids: list[int], n_vocab: int, extra: tuple[str, ...] = ()) -> torch.Tensor | str:
    """llama-server's whole next-token distribution after each prefix of ids, or why it did not
    start (its last error line: llama.cpp's phi3 vocabulary wants Phi's own special tokens)."""
    port = free_port()
    cmd = [str(BIN / "llama-server"), "-m", str(path), "--port", str(port), "-c", "1024", "-np", "1", "-t", "2"]
    cmd += list(extra)
    cmd += ["-ctk", "f32", "-ctv", "f32"]  # as ubatch's side: the weights are what is compared
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                errors = [x for x in (proc.stderr.read() if proc.stderr else "").splitlines() if " E " in x]
                return (errors[-1].split(" E ", 1)[1] if errors else "no error line").strip()
            time.sleep(0.2)
        # the server holds back a sampled token that ends inside a UTF-8 character, with its probs:
        # byte tokens are never sampled (logit_bias acts on sampling; n_probs reports raw logits)
        from ubatch.engine.gguf.file import open_gguf

        types = open_gguf(path).metadata["tokenizer.ggml.token_type"]
        no_bytes = [[i, False] for i, t in enumerate(types) if int(t) == 6]
        rows = []
        with httpx.Client(timeout=60) as c:
            for i in range(1, len(ids) + 1):
                body = {"prompt": ids[:i], "n_predict": 1, "n_probs": n_vocab, "cache_prompt": True, "temperature": 0,
                        "logit_bias": no_bytes}  # fmt: skip
                r = c.post(url + "/completion", json=body).json()
                if "completion_probabilities" not in r:
                    raise SystemExit(f"llama-server on {path.name}, prefix {i}: {str(r)[:500]}")
                top = r["completion_probabilities"][0]["top_logprobs"]
                row = torch.full((n_vocab,), -math.inf, dtype=torch.float64)
                for t in top:
                    row[t["id"]] = t["logprob"]
                rows.append(row)
        return torch.stack(rows)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kld(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || other) over the rows, and how often their top-1 agree."""
    p = ref.exp()
    terms = torch.where(p > 0, p * (ref - other.clamp(min=-1e4)), torch.zeros_like(p))
    return terms.sum(-1).mean().item(), (ref.argmax(-1) == other.argmax(-1)).double().mean().item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(tiny_families.FAMILIES))
    ap.add_argument("-n", type=int, default=128, help="positions compared per file")
    ap.add_argument("--types", default="F32,F16,Q8_0,Q4_K_M")
    a = ap.parse_args()
    if tiny_families.llama_cpp_src() is None or not (BIN / "llama-server").exists():
        raise SystemExit("needs llama.cpp's source and build (../shared/tools/llama-cpp.sh)")
    ids = torch.randint(3, tiny_families.VOCAB, (a.n,), generator=torch.Generator().manual_seed(11)).tolist()
    print(
        "| family | GGUF arch | file | ubatch KLD | ubatch top-1 | llama.cpp KLD | llama.cpp top-1 | ubatch vs llama.cpp KLD |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for family in a.families.split(","):
            d = tiny_families.write_hf(work / family, family)
            with torch.no_grad():
                logits = tiny_families.hf_model(family)(torch.tensor([ids])).logits[0]
            ref = torch.log_softmax(logits.double(), -1)
            for qtype in a.types.split(","):
                f = gguf_of(d, work, family, qtype)
                ours = ubatch_logprobs(f, ids)
                theirs = llama_cpp_logprobs(f, ids, ref.shape[1])
                if isinstance(theirs, str):
                    # tiny deepseek2 F16/Q8_0 files abort llama.cpp's scheduler when the CPU's
                    # repacked weight buffers take their 3-D k_b / v_b; unpacked, they run
                    again = llama_cpp_logprobs(f, ids, ref.shape[1], ("--no-repack",))
                    theirs, qtype = (
                        (again, f"{qtype} (llama.cpp --no-repack)") if not isinstance(again, str) else (theirs, qtype)
                    )
                (uk, ut), arch = kld(ref, ours), tiny_families.family_of(family).gguf_arch
                if isinstance(theirs, str):
                    print(f"| {family} | {arch} | {qtype} | {uk:.2e} | {100 * ut:.1f}% | llama.cpp: {theirs} | | |")
                    continue
                (lk, lt), (cross, _) = kld(ref, theirs), kld(theirs, ours)
                print(
                    f"| {family} | {arch} | {qtype} | {uk:.2e} | {100 * ut:.1f}% | {lk:.2e} | {100 * lt:.1f}% | {cross:.2e} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
