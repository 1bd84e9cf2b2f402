"""Rewrite docs/compat.md from the code's tables (see cli/compat.py)."""

from pathlib import Path

from ubatch.cli.llama.compat import current

if __name__ == "__main__":
    path = Path(__file__).resolve().parent.parent / "docs" / "compat.md"
    path.write_text(current())
    print(f"wrote {path}")
