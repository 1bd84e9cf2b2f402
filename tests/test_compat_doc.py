"""docs/compat.md is the table the code would write now (regenerate: python scripts/compat_table.py)."""

from pathlib import Path

from ubatch.cli.llama.compat import current


def test_compat_doc_is_current() -> None:
    doc = Path(__file__).resolve().parent.parent / "docs" / "compat.md"
    assert doc.read_text() == current(), "docs/compat.md is stale: run python scripts/compat_table.py"


def test_compat_doc_names_every_status() -> None:
    text = current()
    for needle in (
        "| `-ngl`, `--gpu-layers`, `--n-gpu-layers` | no effect |",
        "| `--lora` | refused |",
        "| `-c`, `--ctx-size` | implemented |",
    ):
        assert needle in text
    assert "`POST /v1/embeddings` | implemented" in text and "`POST /models/load` | missing" in text
    assert "`POST /v1/responses` | implemented" in text and "`POST /v1/messages` | implemented" in text
