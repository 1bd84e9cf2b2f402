"""Corrupt GGUF files, built from a real one: each must be refused in one line naming the file
(and the key), before anything is sized from it, by the loader and by `info`, `cli` and `server`.

The corpus rewrites the tiny gemma3 model written by gguf-py: metadata values retyped, zeroed,
NaN/inf, absurd counts and sizes, per-layer arrays of the wrong length, tensor infos with huge,
negative or misaligned dimensions, and truncations inside every section of the file.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.file import _Cursor
from ubatch.engine.model.model import Model

U32, I32, F32, BOOL, STR, ARR, U64 = 4, 5, 6, 7, 8, 9, 10
_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
GiB = 2**30


def s8(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def enc(vtype: int, value: object, etype: int = 0) -> bytes:
    """A metadata value (type code + payload) as GGUF stores it."""
    if vtype == STR:
        return struct.pack("<I", STR) + s8(str(value))
    if vtype == ARR:
        items = list(value)  # type: ignore[call-overload]
        body = b"".join(s8(x) if etype == STR else struct.pack(_FMT[etype], x) for x in items)
        return struct.pack("<IIQ", ARR, etype, len(items)) + body
    return struct.pack("<I", vtype) + struct.pack(_FMT[vtype], value)


@dataclass
class Gguf:
    """A GGUF file as editable pieces: raw metadata values by key, tensor infos, the data bytes."""

    kv: dict[str, bytes]  # key -> type code + payload
    tensors: list[list]  # [name, ne, ggml type, offset]
    data: bytes
    header: dict[str, int] = field(default_factory=dict)  # overrides: n_tensors, n_kv, version

    @classmethod
    def read(cls, path: Path) -> Gguf:
        buf = memoryview(path.read_bytes())
        cur = _Cursor(buf)
        cur.pos = 8
        n_tensors, n_kv = cur.take("<q", 8), cur.take("<q", 8)
        kv = {}
        for _ in range(n_kv):
            key = cur.string()
            start = cur.pos
            cur.value(cur.take("<I", 4))
            kv[key] = bytes(buf[start : cur.pos])
        tensors = []
        for _ in range(n_tensors):
            name = cur.string()
            ne = [cur.take("<q", 8) for _ in range(cur.take("<I", 4))]
            tensors.append([name, ne, cur.take("<I", 4), cur.take("<Q", 8)])
        data_offset = -(-cur.pos // 32) * 32
        return cls(kv, tensors, bytes(buf[data_offset:]))

    def bytes(self) -> tuple[bytes, dict[str, int]]:
        """The file, and where each section starts (for truncations)."""
        h = self.header
        out = b"GGUF" + struct.pack("<I", h.get("version", 3))
        out += struct.pack("<QQ", h.get("n_tensors", len(self.tensors)), h.get("n_kv", len(self.kv)))
        marks = {"metadata": len(out)}
        out += b"".join(s8(k) + v for k, v in self.kv.items())
        marks["tensor_infos"] = len(out)
        for name, ne, t, off in self.tensors:
            out += s8(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<q", x) for x in ne)
            out += struct.pack("<IQ", t, off)
        marks["padding"] = len(out)
        out += b"\0" * (-len(out) % 32)
        marks["data"] = len(out)
        return out + self.data, marks

    def tensor(self, name: str) -> list:
        return next(t for t in self.tensors if t[0] == name)


A = "gemma3."
Edit = Callable[[Gguf], None]


def setkv(key: str, raw: bytes) -> Edit:
    return lambda g: g.kv.__setitem__(key, raw)


def drop_last(key: str, etype: int) -> Edit:
    def f(g: Gguf) -> None:
        raw = g.kv[key]
        n = struct.unpack_from("<Q", raw, 8)[0]
        size = struct.calcsize(_FMT[etype])
        g.kv[key] = struct.pack("<IIQ", ARR, etype, n - 1) + raw[16 : 16 + (n - 1) * size]

    return f


def patch_count(key: str, count: int) -> Edit:
    return lambda g: g.kv.__setitem__(key, g.kv[key][:8] + struct.pack("<Q", count) + g.kv[key][16:])


def tensor_edit(name: str, i: int, value: object) -> Edit:
    return lambda g: g.tensor(name).__setitem__(i, value)


def header(**kw: int) -> Edit:
    return lambda g: g.header.update(kw)


# name -> (edit, a string the one-line error must contain)
METADATA_CASES: dict[str, tuple[Edit, str]] = {
    "block_count_1e9": (setkv(A + "block_count", enc(U32, 10**9)), "block_count"),
    "block_count_0": (setkv(A + "block_count", enc(U32, 0)), "block_count"),
    "block_count_3_of_4": (setkv(A + "block_count", enc(U32, 3)), "block_count"),
    "block_count_100": (setkv(A + "block_count", enc(U32, 100)), "block_count"),
    "block_count_string": (setkv(A + "block_count", enc(STR, "4")), "block_count"),
    "block_count_bool": (setkv(A + "block_count", enc(BOOL, True)), "block_count"),
    "block_count_nan": (setkv(A + "block_count", enc(F32, float("nan"))), "block_count"),
    "head_count_0": (setkv(A + "attention.head_count", enc(U32, 0)), "head_count"),
    "head_count_inf": (setkv(A + "attention.head_count", enc(F32, float("inf"))), "head_count"),
    "head_count_kv_0": (setkv(A + "attention.head_count_kv", enc(U32, 0)), "head_count_kv"),
    "head_count_kv_3": (setkv(A + "attention.head_count_kv", enc(U32, 3)), "head_count_kv"),
    "head_count_kv_array_short": (setkv(A + "attention.head_count_kv", enc(ARR, [2, 2], U32)), "head_count_kv"),
    "key_length_0": (setkv(A + "attention.key_length", enc(U32, 0)), "key_length"),
    "value_length_0": (setkv(A + "attention.value_length", enc(U32, 0)), "value_length"),
    "embedding_length_0": (setkv(A + "embedding_length", enc(U32, 0)), "embedding_length"),
    "embedding_length_huge": (setkv(A + "embedding_length", enc(U64, 10**12)), "embedding_length"),
    "feed_forward_0": (setkv(A + "feed_forward_length", enc(U32, 0)), "feed_forward_length"),
    "context_length_0": (setkv(A + "context_length", enc(U32, 0)), "context_length"),
    "context_length_negative": (setkv(A + "context_length", enc(I32, -1)), "context_length"),
    "rms_eps_nan": (setkv(A + "attention.layer_norm_rms_epsilon", enc(F32, float("nan"))), "epsilon"),
    "rms_eps_0": (setkv(A + "attention.layer_norm_rms_epsilon", enc(F32, 0.0)), "epsilon"),
    "rms_eps_string": (setkv(A + "attention.layer_norm_rms_epsilon", enc(STR, "1e-6")), "epsilon"),
    "freq_base_inf": (setkv(A + "rope.freq_base", enc(F32, float("inf"))), "freq_base"),
    "freq_base_negative": (setkv(A + "rope.freq_base", enc(F32, -1.0)), "freq_base"),
    "rope_dim_odd": (setkv(A + "rope.dimension_count", enc(U32, 31)), "dimension_count"),
    "rope_dim_too_big": (setkv(A + "rope.dimension_count", enc(U32, 64)), "dimension_count"),
    "swa_pattern_short": (setkv(A + "attention.sliding_window_pattern", enc(ARR, [1, 0, 1], BOOL)), "pattern"),
    "swa_pattern_string": (setkv(A + "attention.sliding_window_pattern", enc(STR, "x")), "pattern"),
    "sliding_window_negative": (setkv(A + "attention.sliding_window", enc(I32, -8)), "sliding_window"),
    "vocab_size_1e9": (setkv(A + "vocab_size", enc(U32, 10**9)), "vocab_size"),
    "vocab_size_mismatch": (setkv(A + "vocab_size", enc(U32, 100)), "vocab_size"),
    "arch_int": (setkv("general.architecture", enc(U32, 7)), "architecture"),
    "alignment_string": (setkv("general.alignment", enc(STR, "32")), "alignment"),
    "alignment_3": (setkv("general.alignment", enc(U32, 3)), "alignment"),
    "tokenizer_model_int": (setkv("tokenizer.ggml.model", enc(U32, 1)), "tokenizer.ggml.model"),
    "tokens_ints": (setkv("tokenizer.ggml.tokens", enc(ARR, [1, 2, 3], U32)), "tokenizer.ggml.tokens"),
    "token_type_short": (drop_last("tokenizer.ggml.token_type", I32), "token_type"),
    "scores_short": (drop_last("tokenizer.ggml.scores", F32), "scores"),
    "bos_string": (setkv("tokenizer.ggml.bos_token_id", enc(STR, "2")), "bos_token_id"),
    "add_bos_string": (setkv("tokenizer.ggml.add_bos_token", enc(STR, "yes")), "add_bos_token"),
}
STRUCTURE_CASES: dict[str, tuple[Edit, str]] = {
    "n_kv_1e12": (header(n_kv=10**12), "cannot fit"),
    "n_tensors_1e12": (header(n_tensors=10**12), "cannot fit"),
    "version_99": (header(version=99), "version"),
    "tokens_count_1e12": (patch_count("tokenizer.ggml.tokens", 10**12), "truncated"),
    "scores_count_1e12": (patch_count("tokenizer.ggml.scores", 10**12), "truncated"),
    "tensor_dims_huge": (tensor_edit("token_embd.weight", 1, [64, 10**15]), "token_embd.weight"),
    "tensor_dim_negative": (tensor_edit("output_norm.weight", 1, [-64]), "output_norm.weight"),
    "tensor_5_dims": (tensor_edit("output_norm.weight", 1, [64, 1, 1, 1, 1]), "output_norm.weight"),
    "tensor_type_99": (tensor_edit("output_norm.weight", 2, 99), "output_norm.weight"),
    "tensor_offset_misaligned": (tensor_edit("output_norm.weight", 3, 7), "output_norm.weight"),
    "tensor_wrong_shape": (tensor_edit("blk.1.attn_norm.weight", 1, [32]), "blk.1.attn_norm.weight"),
    "tensor_missing": (lambda g: g.tensors.remove(g.tensor("blk.2.ffn_up.weight")), "blk.2.ffn_up.weight"),
    "tensor_extra_layer": (
        lambda g: g.tensors.append(["blk.7.attn_norm.weight", [64], 0, g.tensor("output_norm.weight")[3]]),
        "block_count",
    ),
    "tensor_duplicate": (lambda g: g.tensors.append(list(g.tensor("output_norm.weight"))), "duplicate"),
}


@pytest.fixture(scope="module")
def source(tiny_gemma: Path) -> Gguf:
    return Gguf.read(tiny_gemma)


def write(source: Gguf, edit: Edit, path: Path) -> Path:
    g = Gguf(dict(source.kv), [list(t) for t in source.tensors], source.data, {})
    edit(g)
    path.write_bytes(g.bytes()[0])
    return path


def refusal(path: Path) -> str:
    with pytest.raises(ModelLoadError) as e:
        Model.load(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def test_the_source_file_loads_after_a_round_trip(source: Gguf, tmp_path: Path) -> None:
    m = Model.load(write(source, lambda g: None, tmp_path / "same.gguf"))  # the corpus starts from a valid file
    assert m.hparams.n_layer == 4 and m.vocab.n_tokens == m.hparams.n_vocab


@pytest.mark.parametrize("case", [*METADATA_CASES, *STRUCTURE_CASES])
def test_corrupt_file_is_refused_in_one_line(source: Gguf, tmp_path: Path, case: str) -> None:
    edit, needle = {**METADATA_CASES, **STRUCTURE_CASES}[case]
    msg = refusal(write(source, edit, tmp_path / f"{case}.gguf"))
    assert needle in msg, msg


def test_truncation_inside_every_section_is_refused(source: Gguf, tmp_path: Path) -> None:
    data, marks = Gguf(source.kv, source.tensors, source.data).bytes()
    cuts = [3, 6, 12, 20, marks["metadata"] + 5, (marks["metadata"] + marks["tensor_infos"]) // 2]
    cuts += [marks["tensor_infos"] + 3, (marks["tensor_infos"] + marks["padding"]) // 2, marks["padding"]]
    cuts += [marks["data"] + 100, (marks["data"] + len(data)) // 2, len(data) - 1]
    for cut in cuts:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        msg = refusal(p)
        assert "truncated" in msg or "not a GGUF" in msg, (cut, msg)


# A child started straight from this process inherits its peak RSS: Linux carries the old memory's
# high-water mark across exec into the child's rusage, and the pytest process is large by now. A
# small wrapper forks the command (its fresh memory is the wrapper's few MiB), waits for it and
# writes the command's own peak.
_MEASURE = """import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(argv: list[str], timeout: float = 90) -> tuple[int, str, int]:
    """(exit code, stderr, peak RSS in bytes) of one child process, from its own rusage."""
    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as rss:
        wrapped = [sys.executable, "-S", "-c", _MEASURE, rss.name, *argv]
        p = subprocess.Popen(wrapped, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        killer = threading.Timer(timeout, lambda: os.killpg(p.pid, signal.SIGKILL))
        killer.start()
        try:
            p.wait()
        finally:
            killer.cancel()
        err.seek(0)
        return p.returncode, err.read().decode(errors="replace"), int(rss.read() or 0) * 1024


CLI_CASES = ["block_count_1e9"]  # the rest in-process above: each child costs seconds of torch import
COMMANDS = {"info": ["info"], "cli": ["cli", "-p", "x", "-n", "1"], "server": ["server", "--port", "0"]}


def test_every_command_refuses_corrupt_files_in_one_line_under_1_gib(source: Gguf, tmp_path: Path) -> None:
    files = {c: write(source, {**METADATA_CASES, **STRUCTURE_CASES}[c][0], tmp_path / f"{c}.gguf") for c in CLI_CASES}
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Gguf(source.kv, source.tensors, source.data).bytes()[0][:-1])
    files["truncated_data"] = cut
    runs = [(c, cmd) for c in files for cmd in COMMANDS]
    base = [sys.executable, "-m", "ubatch.cli.main"]
    with ThreadPoolExecutor(4) as pool:  # each child pays ~3 s to import torch: run them side by side
        results = list(pool.map(lambda r: run_measured([*base, *COMMANDS[r[1]], "-m", str(files[r[0]])]), runs))
    for (case, cmd), (rc, err, rss) in zip(runs, results):
        lines = [x for x in err.splitlines() if x.strip()]
        if cmd == "server":  # its startup log comes first; the refusal is still one line, and it exits
            lines = [x for x in lines if "error" in x.lower()]
        assert rc == 1 and len(lines) == 1 and "Traceback" not in err, (case, cmd, rc, err)
        assert str(files[case]) in lines[0], (case, cmd, err)
        assert rss < GiB, (case, cmd, rss)


def test_info_for_a_huge_context_allocates_nothing(tiny_gemma: Path) -> None:
    """-c 2e9 is terabytes of KV cache: `info` plans it (or refuses it in one line), never allocates it."""
    argv = [sys.executable, "-m", "ubatch.cli.main", "info", "-m", str(tiny_gemma), "-c", "2000000000"]
    rc, err, rss = run_measured(argv)
    assert rss < GiB, rss
    assert "Traceback" not in err
    if rc != 0:  # refused before allocating: one line that says what it needs and what to lower
        lines = [x for x in err.splitlines() if x.strip()]
        assert rc == 1 and len(lines) == 1 and "needs" in lines[0] and "-c" in lines[0], err
