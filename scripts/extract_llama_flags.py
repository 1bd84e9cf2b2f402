"""Write cli/llama/llama_flags.json: every flag llama.cpp's tools accept, read from llama.cpp's source.

The table is data (names, value hints, environment variables, which tools take each flag), so
ubatch can accept every llama.cpp command line and tests can prove it without llama.cpp present.
Sources: common/arg.cpp (every tool but llama-bench) and tools/llama-bench/llama-bench.cpp
(llama-bench parses its own flags). Run it again when moving to a newer llama.cpp:

    python scripts/extract_llama_flags.py /path/to/llama.cpp > cli/llama/llama_flags.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def _skip_literal(s: str, i: int) -> int:
    """Index after the string or char literal starting at s[i] (raw strings included)."""
    if s.startswith('R"', i):
        j = s.index("(", i)
        end = ")" + s[i + 2 : j] + '"'
        return s.index(end, j) + len(end)
    q, i = s[i], i + 1
    while s[i] != q:
        i += 2 if s[i] == "\\" else 1
    return i + 1


def _split_call(s: str, i: int) -> tuple[list[str], int]:
    """Top-level comma-separated arguments of the call whose '(' is at s[i]; index after ')'."""
    args, depth, start, i = [], 0, i + 1, i + 1
    while True:
        c = s[i]
        if c in "\"'" or s.startswith('R"', i):
            i = _skip_literal(s, i)
            continue
        if s.startswith("//", i):
            i = s.index("\n", i)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                args.append(s[start:i].strip())
                return args, i + 1
            depth -= 1
        elif c == "," and depth == 0:
            args.append(s[start:i].strip())
            start = i + 1
        i += 1


def _strings(expr: str) -> list[str]:
    """The string literals of an expression, concatenated per adjacency group."""
    return [bytes(m, "utf-8").decode("unicode_escape") for m in re.findall(r'"((?:[^"\\]|\\.)*)"', expr)]


def _brace_list(expr: str) -> list[str] | None:
    expr = re.sub(r"//[^\n]*", "", expr).strip()
    return _strings(expr) if expr.startswith("{") else None


def arg_cpp_flags(src: str) -> list[dict]:
    out = []
    for m in re.finditer(r"add_opt\(common_arg\(", src):
        args, end = _split_call(src, m.end() - 1)
        names = _brace_list(args[0]) or []
        neg = _brace_list(args[1]) if len(args) > 1 and args[1].startswith("{") else None
        rest = args[2:] if neg is not None else args[1:]
        plain = rest[:-1]  # the handler lambda is last
        value = (_strings(plain[0]) or ["VALUE"])[0] if len(plain) >= 2 else None  # a computed hint: VALUE
        value2 = (_strings(plain[1]) or ["VALUE"])[0] if len(plain) >= 3 else None
        help_parts = _strings(plain[-1]) if plain else []
        chain_end = src.index(");", end)  # the .set_*() calls after common_arg(...)
        chain = src[end:chain_end]
        named = re.search(r"set_examples\((\w+)\)", chain)
        if named:  # a list declared once: static std::initializer_list<enum llama_example> NAME = {...}
            chain += re.search(named.group(1) + r" = \{([^}]*)\}", src).group(1)
        examples = re.findall(r"LLAMA_EXAMPLE_(\w+)", (re.search(r"set_examples\(\{([^}]*)\}", chain) or [""])[0])
        examples += re.findall(r"LLAMA_EXAMPLE_(\w+)", chain[chain_end - end :]) if named else []
        excludes = re.findall(r"LLAMA_EXAMPLE_(\w+)", (re.search(r"set_excludes\(\{([^}]*)\}", chain) or [""])[0])
        env = re.search(r'set_env\("([^"]+)"\)', chain)
        if not names:
            continue
        out.append(
            {
                "names": names,
                "neg": neg or [],
                "value": value,
                "value2": value2,
                "env": env.group(1) if env else None,
                "examples": [e.lower() for e in examples] or ["common"],
                "excludes": [e.lower() for e in excludes],
                "sampling": ".set_sampling()" in chain,
                "spec": ".set_spec()" in chain,
                "preset_only": ".set_preset_only()" in chain,
                "help": (help_parts[0].split("\n")[0] if help_parts else "").strip(),
            }
        )
    return out


def bench_flags(src: str) -> list[dict]:
    """llama-bench's print_usage lines: '  -a, --long <hint>   help'."""
    usage = src[src.index("static void print_usage") :]
    usage = usage[: usage.index("\n}\n")]
    out = []
    for line in _strings(usage):
        m = re.match(r"\s+((?:-[\w-]+(?:,? )?)+)\s*(<[^>]*>)?\s*(.*)", line)
        if not m or not m.group(1).strip().startswith("-"):
            continue
        names = [n for n in re.split(r"[, ]+", m.group(1).strip()) if n.startswith("-")]
        help_text = m.group(3).split("(default")[0].strip()
        out.append(
            {
                "names": names,
                "neg": [],
                "value": m.group(2),
                "value2": None,
                "env": None,
                "examples": ["llama_bench"],
                "excludes": [],
                "sampling": False,
                "spec": False,
                "preset_only": False,
                "help": help_text,
            }
        )
    return out


def server_routes(src: str) -> list[list[str]]:
    """llama-server's route table: ctx_http.get/post/del("PATH", ...) in server.cpp."""
    seen: list[list[str]] = []
    for method, path in re.findall(r'ctx_http\.(get|post|put|del)\s*\("([^"]+)"', src):
        row = [{"del": "DELETE"}.get(method, method.upper()), path]
        if row not in seen:
            seen.append(row)
    return seen


def main() -> None:
    root = Path(sys.argv[1])
    flags = arg_cpp_flags((root / "common/arg.cpp").read_text())
    flags += bench_flags((root / "tools/llama-bench/llama-bench.cpp").read_text())
    routes = server_routes((root / "tools/server/server.cpp").read_text())
    print('{"source": "llama.cpp common/arg.cpp, tools/llama-bench/llama-bench.cpp, tools/server/server.cpp",')
    print('"routes": ' + json.dumps(routes) + ",")
    print('"flags": [\n' + ",\n".join(json.dumps(f, separators=(",", ":")) for f in flags) + "\n]}")


if __name__ == "__main__":
    main()
