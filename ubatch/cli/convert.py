"""`ubatch convert DIR -o FILE.gguf`: a Hugging Face checkpoint written as a GGUF file.

No llama.cpp tool has this command line (llama.cpp converts with a Python script), so it is a
plain command: the directory, the output file and llama.cpp's `--outtype` names.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ubatch.cli.common import err_console, user_errors
from ubatch.engine.errors import UbatchError

# engine.model.hf.convert's OUTTYPES, named here so that --help and a bad --outtype do not import
# torch with the converter (tests/test_startup.py checks that the two agree)
OUTTYPES = ("f32", "f16", "bf16", "q8_0")


@user_errors
def convert(
    model_dir: Path = typer.Argument(
        ..., help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.model)"
    ),
    outfile: Path = typer.Option(..., "-o", "--outfile", help="the GGUF file to write"),
    outtype: str = typer.Option("f16", "--outtype", help=f"matrix type: {', '.join(OUTTYPES)} (norms stay f32)"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="one line per tensor"),
) -> None:
    if outtype not in OUTTYPES:
        raise UbatchError(f"--outtype {outtype!r}: expected one of {', '.join(OUTTYPES)}")
    if not model_dir.is_dir():
        raise UbatchError(f"{model_dir}: not a directory; pass a Hugging Face checkpoint directory")
    from ubatch.engine.model.hf.convert import convert as convert_checkpoint

    out = convert_checkpoint(model_dir, outfile, outtype, err_console.print if verbose else None)
    err_console.print(f"wrote {out} ({out.stat().st_size:,} bytes, {outtype})")
