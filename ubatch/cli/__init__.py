"""Command-line front end (Typer) and presentation (Rich)."""
