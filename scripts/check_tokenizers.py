"""Compare ubatch's tokenizer with llama.cpp's on random texts, and time both on 1 MB of text.

    python scripts/check_tokenizers.py [--texts N] [--seed S] [VOCAB ...]   ids and detokenisation
    python scripts/check_tokenizers.py --bench [VOCAB ...]                  llama-tokenize vs ubatch tokenize
    python scripts/check_tokenizers.py --bench-encode [VOCAB ...]           llama_tokenize vs Vocab.tokenize

The vocabularies are llama.cpp's test ones (models/ggml-vocab-*.gguf of its sdist, found with
`LLAMA_CPP_SRC=1 ../shared/tools/llama-cpp.sh`). The comparison calls llama.cpp's own
llama_tokenize/llama_detokenize through a small C program built against the libllama.so of
../shared/tools/llama-cpp.sh's build (it never starts that build), so every text costs no process
start and the bytes of the detokenisation are llama.cpp's. Texts mix scripts, whitespace runs,
numbers, code, emoji, special-token texts and invalid UTF-8 bytes (given to ubatch as
surrogate escapes, as `ubatch` reads undecodable input).
"""

from __future__ import annotations

import argparse
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO.parent / "shared" / "tools" / "llama-cpp.sh"
VOCABS = (
    "bert-bge command-r deepseek-coder deepseek-llm falcon gemma-4 gpt-2 llama-bpe llama-spm mpt phi-3 qwen2 qwen35 "
    "refact starcoder"
).split()  # the ones with llama.cpp's .inp/.out cases
EXTRA = "aquila baichuan gpt-neox nomic-bert-moe".split()  # no cases: no tokenizer.ggml.pre, SPM, Unigram

_HELPER_C = r"""
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static void quiet(enum ggml_log_level l, const char * t, void * u) { (void) l; (void) t; (void) u; }
int main(int argc, char ** argv) {
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    struct llama_model * m = llama_model_load_from_file(argv[1], mp);
    if (!m) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab * v = llama_model_get_vocab(m);
    unsigned int n; unsigned char fl;
    while (fread(&n, 4, 1, stdin) == 1 && fread(&fl, 1, 1, stdin) == 1) {
        char * text = malloc(n + 1);
        if (n && fread(text, 1, n, stdin) != n) return 1;
        int cap = n + 16;
        llama_token * ids = malloc(sizeof(llama_token) * cap);
        struct timespec t0, t1, c0, c1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
        int k = llama_tokenize(v, text, n, ids, cap, fl & 1, fl & 2);
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        long long ns = (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
        long long cpu = (c1.tv_sec - c0.tv_sec) * 1000000000LL + (c1.tv_nsec - c0.tv_nsec);
        if (k < 0) { cap = -k; ids = realloc(ids, sizeof(llama_token) * cap); k = llama_tokenize(v, text, n, ids, cap, fl & 1, fl & 2); }
        int tcap = 16 * k + 64;
        char * out = malloc(tcap);
        int t = llama_detokenize(v, ids, k, out, tcap, false, false);
        if (t < 0) { tcap = -t; out = realloc(out, tcap); t = llama_detokenize(v, ids, k, out, tcap, false, false); }
        fwrite(&k, 4, 1, stdout); fwrite(ids, sizeof(llama_token), k, stdout);
        fwrite(&t, 4, 1, stdout); fwrite(out, 1, t, stdout); fwrite(&ns, 8, 1, stdout); fwrite(&cpu, 8, 1, stdout); fflush(stdout);
        free(text); free(ids); free(out);
    }
    return 0;
}
"""


def llama_src() -> Path:
    out = subprocess.run([str(TOOL)], env={**os.environ, "LLAMA_CPP_SRC": "1"}, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"cannot find llama.cpp's source with {TOOL}: {out.stderr.strip()[-300:]}")
    return Path(out.stdout.strip())


def llama_bin() -> Path:
    """The build folder of ../shared/tools/llama-cpp.sh (not started here: it takes ~15 minutes)."""
    return Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache" / "ubatch-yardstick")) / "build" / "bin"


def build_helper(src: Path, out_dir: Path) -> Path | None:
    """The C comparison program, or None when libllama.so or a C compiler is missing."""
    lib = llama_bin()
    if not (lib / "libllama.so").exists():
        return None
    c, exe = out_dir / "tok.c", out_dir / "tok"
    c.write_text(_HELPER_C)
    inc = [f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}"]
    cmd = ["cc", "-O1", *inc, str(c), "-o", str(exe), f"-L{lib}", "-lllama", f"-Wl,-rpath,{lib}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        return None
    return exe if r.returncode == 0 else None


class LlamaTokenizer:
    """llama.cpp's tokenizer of one vocabulary, in a child process fed length-prefixed texts."""

    def __init__(self, helper: Path, vocab: Path) -> None:
        self.p = subprocess.Popen([str(helper), str(vocab)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.last_ns = self.last_cpu_ns = 0

    def run(self, text: bytes, add_special: bool, parse_special: bool) -> tuple[list[int], bytes]:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write(struct.pack("<IB", len(text), add_special | parse_special << 1) + text)
        self.p.stdin.flush()
        (k,) = struct.unpack("<i", self.p.stdout.read(4))
        ids = list(struct.unpack(f"<{k}i", self.p.stdout.read(4 * k)))
        (t,) = struct.unpack("<i", self.p.stdout.read(4))
        text_out = self.p.stdout.read(t)
        self.last_ns, self.last_cpu_ns = struct.unpack("<qq", self.p.stdout.read(16))  # llama_tokenize's own time
        return ids, text_out

    def close(self) -> None:
        assert self.p.stdin
        self.p.stdin.close()
        self.p.wait()


_PIECES = [
    "Hello world",
    " the quick brown fox",
    "  \t \n\n   \r\n",
    "I'm you've they'LL it's DON'T",
    "1234567890 3.14159 1,000,000 ٣٤٥ ½",
    "def f(x):\n    return x**2  # comment\n",
    'if (a && b) { c->d[i] = "s"; }',
    "日本語のテキスト、中文文本。한국어",
    "Привет, мир! Ελληνικά",
    "🦙🚀 👨‍👩‍👧 ✨",
    "éàü ñ naïve café Ångström",
    "मराठी हिन्दी",
    "\u00a0\u2003\u3000\u200b\u0085",
    "<s></s><|endoftext|><|im_start|><start_of_turn>[CLS][SEP]<mask>",
    "...!!!???,,,;;;---___",
    "▁ ▁▁ \u2581x",
]


def random_text(rng: random.Random) -> bytes:
    """One text: pieces and random code points, sometimes with bytes that are not UTF-8."""
    parts: list[bytes] = []
    for _ in range(rng.randrange(1, 12)):
        r = rng.random()
        if r < 0.55:
            parts.append(rng.choice(_PIECES).encode())
        elif r < 0.8:
            cps = [
                rng.choice((rng.randrange(0x20, 0x7F), rng.randrange(0x80, 0x3000), rng.randrange(0x1F300, 0x1FAFF)))
            ]
            parts.append("".join(map(chr, cps * rng.randrange(1, 4))).encode())
        elif r < 0.9:
            parts.append(rng.choice([b" ", b"\n", b"\t", b"  ", b"\r\n"]) * rng.randrange(1, 6))
        else:
            # bytes that are not UTF-8; not F5-F7, which with continuations decode past U+10FFFF in
            # llama.cpp and abort it (unicode_cpt_to_utf8 throws); ubatch makes them U+FFFD
            bad = [b for b in range(0x80, 0x100) if not 0xF5 <= b <= 0xF7]
            parts.append(bytes(rng.choice(bad) for _ in range(rng.randrange(1, 3))))
    return b"".join(parts)


@dataclass
class Result:
    vocab: str
    model: str
    pre: str
    checked: int
    bad_ids: int
    bad_text: int
    example: str = ""


def compare(name: str, src: Path, helper: Path, n: int, seed: int, path: Path | None = None) -> Result:
    from ubatch.engine.gguf.file import open_gguf
    from ubatch.engine.vocab.vocab import Vocab

    path = path or src / "models" / f"ggml-vocab-{name}.gguf"
    v = Vocab.from_metadata(open_gguf(path).metadata, name)
    ref = LlamaTokenizer(helper, path)
    rng = random.Random(f"{seed}-{name}")
    res = Result(name, v.model, v.pre, 0, 0, 0)
    try:
        for _ in range(n):
            raw = random_text(rng)
            text = raw.decode("utf-8", "surrogateescape")
            for flags in ((False, False), (True, True)):
                want_ids, want_text = ref.run(raw, *flags)
                got = v.tokenize(text, *flags)
                res.checked += 1
                if got != want_ids:
                    res.bad_ids += 1
                    res.example = res.example or f"{raw!r} {flags}: llama.cpp {want_ids[:16]} ubatch {got[:16]}"
                elif v.detokenize(got) != want_text.decode("utf-8", "replace"):
                    res.bad_text += 1
                    res.example = res.example or f"{raw!r}: llama.cpp {want_text!r} ubatch {v.detokenize(got)!r}"
    finally:
        ref.close()
    return res


def with_pre(src: Path, pre: str, out: Path) -> Path:
    """A copy of the vocabulary `src` whose tokenizer.ggml.pre is `pre` (to try every
    pre-tokeniser llama.cpp names on one vocabulary, which it loads whatever the name)."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, arch=str(r.fields["general.architecture"].contents()))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "tokenizer.ggml.pre"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    w.add_key_value("tokenizer.ggml.pre", pre, gguf.GGUFValueType.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def compare_all_pre(src: Path, helper: Path, n: int, seed: int, base: str = "gpt-2") -> int:
    """Every tokenizer.ggml.pre name llama.cpp knows, on the gpt-2 vocabulary: ids and text."""
    from ubatch.engine.vocab.pre_tokenizer import PRE_TOKENIZERS

    bad = 0
    with tempfile.TemporaryDirectory() as d:
        for pre in sorted(PRE_TOKENIZERS.keys() - {"whitespace"}):  # (llama.cpp asserts: spaces in merges)
            path = with_pre(src / "models" / f"ggml-vocab-{base}.gguf", pre, Path(d) / f"{pre}.gguf")
            r = compare(path.stem, path.parent, helper, n, seed, path=path)
            bad += r.bad_ids + r.bad_text
            print(f"{pre:26s} {PRE_TOKENIZERS[pre].type:18s} {r.checked - r.bad_ids - r.bad_text}/{r.checked} same")
            if r.example:
                print(f"    first difference: {r.example[:300]}")
    return bad


def mixed_text(size: int, seed: int = 0) -> str:
    """~`size` bytes of mixed text (the throughput corpus): paragraphs of Python's own standard
    library (real code, comments and docstrings: prose with a real vocabulary), and random CJK,
    Cyrillic, emoji and numbers between them. Random words keep a word cache honest."""
    rng = random.Random(seed)
    lib = sorted(Path(random.__file__).parent.glob("*.py"))
    out: list[str] = []
    total = 0
    while total < size:
        r = rng.random()
        if r < 0.7:
            lines = rng.choice(lib).read_text(errors="replace").splitlines()
            at = rng.randrange(max(1, len(lines) - 40))
            s = "\n".join(lines[at : at + rng.randrange(5, 40)]) + "\n"
        elif r < 0.8:
            s = "".join(chr(rng.randrange(0x4E00, 0x9FA6)) for _ in range(rng.randrange(5, 60))) + "。\n"
        elif r < 0.87:
            words = ("".join(chr(rng.randrange(0x430, 0x450)) for _ in range(rng.randrange(2, 10))) for _ in range(20))
            s = " ".join(words) + ".\n"
        elif r < 0.93:
            s = " ".join(chr(rng.randrange(0x1F300, 0x1F650)) * rng.randrange(1, 3) for _ in range(rng.randrange(1, 9)))
            s += "\n"
        else:
            s = " ".join(str(rng.randrange(10 ** rng.randrange(1, 12))) for _ in range(rng.randrange(1, 12))) + "\n"
        out.append(s)
        total += len(s.encode())
    return "".join(out)


def _best_of(n: int, cmd: list[str]) -> tuple[float, bytes]:
    """The fastest of n runs of `cmd` (the machine is shared: the minimum is the least disturbed)."""
    best, out = float("inf"), b""
    for _ in range(n):
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, check=True)
        best, out = min(best, time.perf_counter() - t), r.stdout
    return best, out


def bench(names: list[str], src: Path, repeat: int) -> None:
    """llama-tokenize -f FILE --ids vs ubatch tokenize -f FILE --ids: tokens per second of the
    whole command, and of the encoding alone (the command's time less its time on one word, which
    is process start, loading the vocabulary and printing)."""
    exe = llama_bin() / "llama-tokenize"
    if not exe.exists():
        raise SystemExit(f"{exe} is missing: build it with {TOOL}")
    with tempfile.TemporaryDirectory() as d:
        f, one = Path(d) / "mixed.txt", Path(d) / "one.txt"
        f.write_text(mixed_text(1 << 20))
        one.write_text("Hello zqxjv")  # a word no vocabulary holds: the merge table is built in the base run
        print(f"text: {f.stat().st_size} bytes of prose, code, CJK, emoji and digits; cpu: {_cpu()}; best of {repeat}")
        print(f"{'vocab':15s} {'kind':4s} {'tokens':>7s}   {'llama-tokenize':>22s}   {'ubatch tokenize':>22s}")
        print(f"{'':15s} {'':4s} {'':>7s}   {'command':>10s} {'encoding':>11s}   {'command':>10s} {'encoding':>11s}")
        for name in names:
            path = str(src / "models" / f"ggml-vocab-{name}.gguf")
            llama = [str(exe), "-m", path, "--ids", "--log-disable", "--no-escape", "-f"]  # ubatch reads -f as is
            ours = [sys.executable, "-m", "ubatch.cli.main", "tokenize", "-m", path, "--ids", "-f"]
            t_llama, out_llama = _best_of(repeat, [*llama, str(f)])
            t_ours, out_ours = _best_of(repeat, [*ours, str(f)])
            base_llama, _ = _best_of(repeat, [*llama, str(one)])
            base_ours, _ = _best_of(repeat, [*ours, str(one)])
            n = out_llama.count(b",") + 1
            same = "" if out_llama.split() == out_ours.split() else "  (the ids differ!)"
            from ubatch.engine.gguf.file import open_gguf
            from ubatch.engine.vocab.vocab import Vocab

            kind = Vocab.from_metadata(open_gguf(path).metadata, name).kind

            print(
                f"{name:15s} {kind:4s} {n:7d}   {n / t_llama:8.0f}/s {_per_s(n, t_llama - base_llama)}"
                f"   {n / t_ours:8.0f}/s {_per_s(n, t_ours - base_ours)}{same}"
            )


def _per_s(n: int, t: float) -> str:
    """n per second of t, unless t is below the noise of a loaded machine (then no number)."""
    return f"{n / t:9.0f}/s" if t > 0.01 else f"{'(noise)':>11s}"


def bench_in_process(names: list[str], src: Path, repeat: int) -> None:
    """Encoding alone, in one process each: llama_tokenize's time on the text (libllama, timed in
    C) beside Vocab.tokenize's on a freshly loaded vocabulary (its word cache empty), each the
    best of `repeat`, in rounds (llama.cpp's run, then ubatch's, per vocabulary and round) so that
    both meet the same load. Wall time, and the process's CPU time (all its threads: sentencepiece
    encodes in threads of its own; a loaded machine's other work adds less to it than to wall
    time); the ratio is ubatch's tokens/s over llama.cpp's (above 1: faster)."""
    from ubatch.engine.gguf.file import open_gguf
    from ubatch.engine.vocab.vocab import Vocab

    text = mixed_text(1 << 20)
    raw = text.encode()
    with tempfile.TemporaryDirectory() as d:
        helper = build_helper(src, Path(d))
        if helper is None:
            raise SystemExit(f"no libllama.so in {llama_bin()} (or no C compiler): build it with {TOOL}")
        print(f"text: {len(raw)} bytes of prose, code, CJK, emoji and digits; cpu: {_cpu()}; best of {repeat}")
        print(f"load average before: {_load()}")
        head = f"{'llama_tokenize':>14s}   {'Vocab.tokenize':>14s}"
        print(f"{'vocab':15s} {'kind':4s} {'tokens':>7s}   wall: {head} {'ratio':>6s}   cpu: {head} {'ratio':>6s}")
        for name in names:
            path = src / "models" / f"ggml-vocab-{name}.gguf"
            ref = LlamaTokenizer(helper, path)
            t_llama = c_llama = t_ours = c_ours = float("inf")
            ids, same = list[int](), True
            for _ in range(repeat):
                ids, _ = ref.run(raw, True, False)
                t_llama, c_llama = min(t_llama, ref.last_ns / 1e9), min(c_llama, ref.last_cpu_ns / 1e9)
                v = Vocab.from_metadata(open_gguf(path).metadata, name)
                v.tokenize("Hello zqxjv")  # tables built on first use (llama.cpp builds them at load)
                t, c = time.perf_counter(), time.process_time()
                got = v.tokenize(text, True, False)
                c, t = time.process_time() - c, time.perf_counter() - t
                t_ours, c_ours, same = min(t_ours, t), min(c_ours, c), same and got == ids
            ref.close()
            n = len(ids)
            print(
                f"{name:15s} {v.kind:4s} {n:7d}   wall: {n / t_llama:12.0f}/s   {n / t_ours:12.0f}/s {t_llama / t_ours:6.2f}"
                f"   cpu: {n / c_llama:12.0f}/s   {n / c_ours:12.0f}/s {c_llama / c_ours:6.2f}"
                f"{'' if same else '  (ids differ!)'}"
            )
        print(f"load average after: {_load()}")


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vocabs", nargs="*", default=VOCABS + EXTRA)
    ap.add_argument("--texts", type=int, default=200, help="random texts per vocabulary")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bench", action="store_true", help="time llama-tokenize and ubatch tokenize on 1 MB")
    ap.add_argument("--repeat", type=int, default=3, help="--bench: runs of each command (the fastest counts)")
    ap.add_argument("--all-pre", action="store_true", help="every tokenizer.ggml.pre name, on the gpt-2 vocabulary")
    ap.add_argument("--bench-encode", action="store_true", help="encoding alone: llama_tokenize vs Vocab.tokenize")
    a = ap.parse_args()
    src = llama_src()
    if a.bench:
        bench(a.vocabs, src, a.repeat)
        return
    if a.bench_encode:
        bench_in_process(a.vocabs, src, a.repeat)
        return
    with tempfile.TemporaryDirectory() as d:
        helper = build_helper(src, Path(d))
        if helper is None:
            raise SystemExit(f"no libllama.so in {llama_bin()} (or no C compiler): build it with {TOOL}")
        if a.all_pre:
            sys.exit(1 if compare_all_pre(src, helper, a.texts, a.seed) else 0)
        bad = 0
        for name in a.vocabs:
            r = compare(name, src, helper, a.texts, a.seed)
            bad += r.bad_ids + r.bad_text
            print(f"{r.vocab:16s} {r.model:7s} {r.pre:15s} {r.checked - r.bad_ids - r.bad_text}/{r.checked} same")
            if r.example:
                print(f"    first difference: {r.example[:400]}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
