"""scripts/bench_cpu.py's yardstick handling and the CPU name benchmarks record."""

from __future__ import annotations

import importlib.util
import stat
import sys
from pathlib import Path

import pytest

from ubatch.kernels.cpu.build import cpu_model

ROOT = Path(__file__).resolve().parents[1]

INTEL = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 167\nmodel name\t: Intel(R) Xeon(R) Processor\n\nprocessor\t: 1\n"
AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
NAMED = "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85\nmodel name\t: Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz\n"


def test_cpu_model_names_bare_cloud_cpus() -> None:
    assert cpu_model(INTEL) == "Intel(R) Xeon(R) Processor (family 6 model 167 as reported)"
    assert cpu_model(AMD) == "AMD EPYC (Zen 5, family 26 model 2)"
    assert cpu_model(NAMED) == "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz"  # a full name stays as it is


def _bench_cpu():
    spec = importlib.util.spec_from_file_location("bench_cpu", ROOT / "scripts" / "bench_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _fake_llama_bench(tmp_path: Path, body: str) -> Path:
    exe = tmp_path / "llama-bench"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return tmp_path


@pytest.mark.parametrize("fails", ["kill -ILL $$", "exit 3", ""])
def test_llama_cpp_measured_without_repacking_only_where_repacking_fails(tmp_path: Path, fails: str) -> None:
    # like llama.cpp's AMX path on some virtual machines: SIGILL unless --repack 0 is given; an
    # error exit (not a signal) with repacking on is handled the same way
    body = f'case "$*" in *"--repack 0"*) exit 0;; esac\n{fails}\n' if fails else "exit 0\n"
    mod = _bench_cpu()
    no_repack, line = mod.llama_repack(_fake_llama_bench(tmp_path, body), tmp_path / "m.gguf", 2)
    assert no_repack is bool(fails)
    if fails:
        assert ("signal 4" if "ILL" in fails else "exit status 3") in line and "--repack 0" in line
    else:
        assert line == "llama.cpp: default weight repacking"


def test_a_yardstick_that_always_crashes_stops_the_run(tmp_path: Path) -> None:
    mod = _bench_cpu()
    with pytest.raises(SystemExit, match=r"fails \(signal 4\), with and without --repack 0: broken"):
        mod.llama_repack(_fake_llama_bench(tmp_path, "echo broken >&2\nkill -ILL $$\n"), tmp_path / "m.gguf", 2)


@pytest.mark.parametrize("isa", ["avx2", "native"])
def test_a_missing_build_names_the_command_that_makes_it(tmp_path: Path, monkeypatch, isa: str) -> None:
    """The AVX2 comparison needs llama.cpp built for AVX2 alone: without it the run stops at once
    with the line that builds it (no model is loaded first)."""
    mod = _bench_cpu()
    argv = ["bench_cpu.py", "--isa", isa, "--llama-bin", str(tmp_path / "n"), "--llama-bin-avx2", str(tmp_path / "a")]
    monkeypatch.setattr(sys, "argv", argv)
    want = "LLAMA_CPP_ISA=avx2 ../shared/tools/llama-cpp.sh" if isa == "avx2" else "with ../shared/tools/llama-cpp.sh"
    with pytest.raises(SystemExit, match=want):
        mod.main()


def test_an_unknown_isa_is_refused(monkeypatch) -> None:
    mod = _bench_cpu()
    monkeypatch.setattr(sys, "argv", ["bench_cpu.py", "--isa", "avx512"])
    with pytest.raises(SystemExit, match="use native, avx2 or native,avx2"):
        mod.main()
