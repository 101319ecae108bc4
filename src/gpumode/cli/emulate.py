"""`gpumode emulate` (being written)."""

import typer

app = typer.Typer(help="Create and list emulated hosts.", no_args_is_help=True)
