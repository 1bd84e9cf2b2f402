"""`python -m ubatch`: the `ubatch` command, where the script is not on PATH."""

from ubatch.cli.main import app

app(prog_name="ubatch")
