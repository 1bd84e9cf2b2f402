"""Write ubatch/engine/vocab/unicode_data.py from llama.cpp's src/unicode-data.cpp.

llama.cpp's pre-tokenisers classify code points with its own tables (generated from a newer
UnicodeData.txt than Python's `unicodedata` carries), so the tokenizer reads the same tables:
category flags by range, the White_Space set, the simple lowercase map and the one-code-point
NFD map. Run: python scripts/gen_unicode_data.py [path/to/unicode-data.cpp]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "ubatch" / "engine" / "vocab" / "unicode_data.py"


def _source() -> str:
    if len(sys.argv) > 1:
        return Path(sys.argv[1]).read_text()
    tool = Path(__file__).resolve().parent.parent.parent / "shared" / "tools" / "llama-cpp.sh"
    src = subprocess.run(
        [str(tool)], env={**os.environ, "LLAMA_CPP_SRC": "1"}, capture_output=True, text=True, check=True
    )
    return (Path(src.stdout.strip()) / "src" / "unicode-data.cpp").read_text()


def _table(text: str, name: str) -> list[list[int]]:
    body = text[text.index(name) :]
    body = body[body.index("{") + 1 : body.index("};")]
    if name == "unicode_set_whitespace":
        return [[int(x, 16)] for x in re.findall(r"0x[0-9A-Fa-f]+", body)]
    return [[int(x, 16) for x in re.findall(r"0x[0-9A-Fa-f]+", row)] for row in re.findall(r"\{([^{}]*)\}", body)]


def _lines(name: str, rows: list[list[int]]) -> str:
    cells = [":".join(f"{v:x}" for v in r) for r in rows]
    lines, cur = [], ""
    for c in cells:
        if len(cur) + len(c) + 1 > 100:
            lines.append(cur)
            cur = ""
        cur += c + " "
    lines.append(cur)
    body = "\n".join(f'    "{s}"' for s in lines)
    return f"{name} = (\n{body}\n)\n"


def main() -> None:
    text = _source()
    parts = [
        '"""llama.cpp\'s Unicode tables (src/unicode-data.cpp), written by scripts/gen_unicode_data.py.\n\n'
        "Each table is space-separated hex rows, fields joined by ':'. FLAGS: start:flags (a range runs\n"
        "to the next start); WHITESPACE: code point; LOWERCASE: from:to; NFD: first:last:nfd.\n"
        '"""\n',
        _lines("FLAGS", _table(text, "unicode_ranges_flags")),
        _lines("WHITESPACE", _table(text, "unicode_set_whitespace")),
        _lines("LOWERCASE", _table(text, "unicode_map_lowercase")),
        _lines("NFD", _table(text, "unicode_ranges_nfd")),
    ]
    OUT.write_text("\n".join(parts))
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", str(OUT)], check=False)  # the repository's style
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
