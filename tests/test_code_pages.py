"""Torch's import-time code pages are handed back once the model is loaded (engine/code_pages.py),
and only clean executable mappings are touched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ubatch.engine.model.code_pages import code_mappings

SMAPS = """\
7f0000000000-7f0000100000 r--p 00000000 08:01 10 /venv/torch/lib/libtorch_cpu.so
Rss:                 100 kB
Anonymous:             0 kB
7f0000100000-7f0000400000 r-xp 00100000 08:01 10 /venv/torch/lib/libtorch_cpu.so
Rss:                2048 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000400000-7f0000500000 r-xp 00400000 08:01 11 /venv/torch/lib/libpatched.so
Rss:                  64 kB
Private_Dirty:         4 kB
Anonymous:             4 kB
7f0000500000-7f0000600000 r-xp 00000000 08:01 12 /usr/lib/libc.so.6
Rss:                 512 kB
Anonymous:             0 kB
7f0000600000-7f0000700000 r-xp 00000000 08:01 13 /venv/torch/lib/libc10.so
Rss:                  16 kB
Anonymous:             0 kB"""


def test_only_clean_executable_mappings_of_the_library_dir_are_chosen() -> None:
    got = code_mappings(SMAPS, "/venv/torch/lib/")
    assert got == [(0x7F0000100000, 0x7F0000400000, 2048 * 1024), (0x7F0000600000, 0x7F0000700000, 16 * 1024)]


PROBE = """
import sys, torch
from ubatch.engine.model.model import Model
from ubatch.engine.model.code_pages import code_mappings, release_startup_code
from pathlib import Path
lib = str(Path(torch.__file__).parent / "lib") + "/"
def resident():
    return sum(r for _, _, r in code_mappings(Path("/proc/self/smaps").read_text(), lib))
before = resident()
m = Model.load(sys.argv[1])
after = resident()
x = torch.randn(64, 64)
ok = torch.allclose((x @ x.t()).diagonal(), (x * x).sum(1), rtol=1e-4)  # torch still runs
print(before, after, release_startup_code(), int(ok))
"""


def test_loading_a_model_hands_torchs_code_pages_back(tiny_gemma: Path) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, str(tiny_gemma)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, released, ok = (int(v) for v in out.stdout.split())
    assert ok == 1
    assert before > 16 << 20, "torch's import left less code resident than expected"
    assert released >= before // 2 and after < before // 2
