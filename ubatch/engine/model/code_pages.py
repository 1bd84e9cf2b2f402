"""Hand back the torch library code that only ran while torch was imported.

`import torch` runs the static initialisers of libtorch_cpu (operator registrations for every
kernel of every dtype and device): measured here, 92 MiB of its machine code is resident after
the import, of which inference then touches about a third. llama.cpp's binary is a few MiB, so
those pages alone were most of the peak-RSS gap between `ubatch cli` and llama-completion.
Code pages are clean and file-backed: dropping them from this process's page tables loses
nothing (the kernel re-reads a page from the page cache the next time it runs), so once the
model is loaded, the library's executable mappings are dropped and the few pages that decode
uses come back on their own. A mapping holding any private (copy-on-write) page is left alone,
since dropping it would revert that page to the file's bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14+; Python 3.11's mmap module has no name for it
_PAGE = 4096
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


@functools.lru_cache(maxsize=1)
def _madvise() -> Callable[[int, int, int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        f = ctypes.CDLL(name, use_errno=True).madvise if name else None
    except (OSError, AttributeError):
        return None
    if f is not None:
        f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        f.restype = ctypes.c_int
    return f


def code_mappings(smaps: str, lib_dir: str) -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of the executable file mappings under `lib_dir` that hold no
    private page, from the text of /proc/self/smaps."""
    out: list[tuple[int, int, int]] = []
    cur: list[int] | None = None  # [start, end, eligible (a bool), resident bytes]
    for line in [*smaps.splitlines(), "0-0 ---p 0 0:0 0"]:  # a sentinel header closes the last one
        m = _HEADER.match(line)
        if m:
            if cur and cur[2]:
                out.append((cur[0], cur[1], cur[3]))
            perms, path = m.group(3), m.group(4)
            cur = [int(m.group(1), 16), int(m.group(2), 16), perms == "r-xp" and path.startswith(lib_dir), 0]
        elif cur and line.startswith("Rss:"):
            cur[3] = int(line.split()[1]) * 1024
        elif cur and line.startswith(("Anonymous:", "Private_Dirty:")) and line.split()[1] != "0":
            cur[2] = False
    return out


_released: int | None = None


def release_startup_code() -> int:
    """Drop torch's executable pages from this process, once; the resident bytes dropped (0
    where the platform has no /proc/self/smaps or madvise). Later calls return that figure."""
    global _released
    if _released is not None:
        return _released
    _released = 0
    madvise = _madvise()
    try:
        import torch

        lib_dir = str(Path(torch.__file__).parent / "lib") + "/"
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    if madvise is None:
        return 0
    for lo, hi, resident in code_mappings(smaps, lib_dir):
        if madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
            _released += resident
    return _released


def populate(raw: torch.Tensor) -> bool:
    """Map a memory-mapped tensor's pages into this process now (llama.cpp maps its files with
    MAP_POPULATE). For a mixture's experts: decode reads a few of them a token, at random, so
    without this each expert's first use in a step pays a page fault every 4 KiB (on
    Qwen3-30B-A3B's shapes the first tokens ran at a third of the steady speed). False where the
    platform or kernel cannot (the pages then fault in on first use, as before)."""
    madvise = _madvise()
    if madvise is None or raw.device.type != "cpu" or raw.numel() == 0:
        return False
    start = raw.data_ptr()
    lo = start // _PAGE * _PAGE
    return madvise(lo, start + raw.numel() * raw.element_size() - lo, _MADV_POPULATE_READ) == 0
