"""The flags llama.cpp's tools accept, as data (cli/llama/llama_flags.json, written from llama.cpp's source
by scripts/extract_llama_flags.py), so every ubatch command can accept every llama.cpp command line.

A llama.cpp tool takes the "common" flags plus those tagged with its example; `ubatch cli` stands
for both llama-cli and llama-completion, `ubatch bench` for llama-bench (which parses its own).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

# ubatch command -> the llama.cpp examples whose flags it takes (besides "common")
TOOL_EXAMPLES: dict[str, tuple[str, ...]] = {
    "cli": ("cli", "completion"),
    "server": ("server",),
    "batched-bench": ("bench",),
    "tokenize": ("tokenize",),
    "info": ("server",),
    "bench": ("llama_bench",),
}
# the llama.cpp program each command mirrors (for messages and the compatibility table)
LLAMA_TOOL: dict[str, str] = {
    "cli": "llama-cli / llama-completion",
    "server": "llama-server",
    "batched-bench": "llama-batched-bench",
    "tokenize": "llama-tokenize",
    "info": "llama-server (memory plan only)",
    "bench": "llama-bench",
}


@dataclass(frozen=True, slots=True)
class LlamaFlag:
    names: tuple[str, ...]
    neg: tuple[str, ...]  # the negative spellings of a boolean flag (--no-x)
    value: str | None  # the value hint (None: a flag that takes no value)
    value2: str | None
    env: str | None  # LLAMA_ARG_* (boolean flags also read LLAMA_ARG_NO_*)
    examples: tuple[str, ...]
    sampling: bool
    spec: bool
    help: str

    @property
    def key(self) -> str:
        """The longest spelling: the name tables and messages use."""
        return max(self.names, key=len)

    @property
    def all_names(self) -> tuple[str, ...]:
        return self.names + self.neg

    @property
    def n_values(self) -> int:
        return (self.value is not None) + (self.value2 is not None)


# Flags of earlier llama.cpp versions that scripts still pass (this version has -lm/--load-mode):
# taken by every tool so those command lines keep working.
LEGACY: list[dict] = [
    {"names": ["--mlock"], "neg": [], "value": None, "help": "keep the model in RAM (before --load-mode)"},
    {"names": ["--mmap"], "neg": ["--no-mmap"], "value": None, "help": "memory-map the model (before --load-mode)"},
    {"names": ["-dio", "--direct-io"], "neg": ["-ndio", "--no-direct-io"], "value": None, "help": "direct I/O"},
]


@functools.cache
def _data() -> dict:
    return json.loads((Path(__file__).with_name("llama_flags.json")).read_text())


@functools.cache
def flags_for(tool: str) -> tuple[LlamaFlag, ...]:
    """Every flag the llama.cpp counterpart of `tool` accepts (first definition of each name wins,
    with the tool's own definitions before the common ones, as arg.cpp prefers them)."""
    own = TOOL_EXAMPLES[tool]
    wanted = set(own) | ({"common"} if tool != "bench" else set())
    legacy = [
        {
            "value2": None,
            "env": None,
            "examples": ["common", "llama_bench"],
            "excludes": [],
            "sampling": False,
            "spec": False,
        }
        | r
        for r in LEGACY
    ]
    rows = [r for r in _data()["flags"] + legacy if set(r["examples"]) & wanted and not set(r["excludes"]) & wanted]
    seen: set[str] = set()
    keep: list[tuple[int, dict, tuple[str, ...]]] = []
    for i, r in sorted(enumerate(rows), key=lambda ir: 0 if set(ir[1]["examples"]) & set(own) else 1):
        names = tuple(n for n in r["names"] if n not in seen)
        if names:
            seen.update(r["names"] + r["neg"])
            keep.append((i, r, names))
    out = [
        LlamaFlag(
            names=names,
            neg=tuple(r["neg"]),
            value=r["value"],
            value2=r["value2"],
            env=r["env"],
            examples=tuple(r["examples"]),
            sampling=r["sampling"],
            spec=r["spec"],
            help=r["help"],
        )
        for _, r, names in sorted(keep, key=lambda k: k[0])  # arg.cpp's order
    ]
    return tuple(out)


def server_routes() -> list[tuple[str, str]]:
    """llama-server's route table (method, path)."""
    return [(m, p) for m, p in _data()["routes"]]
