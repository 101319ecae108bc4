"""Entry point: assembles the command groups. Each group lives in its own module and imports heavy things lazily,
so ``gpumode discover`` starts fast."""

from __future__ import annotations

import typer

from gpumode.cli import discover as _discover
from gpumode.cli import emulate as _emulate

app = typer.Typer(
    name="gpumode",
    help="Move GPU hosts, and each GPU in them, between accel, vGPU and passthrough modes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command("discover")(_discover.discover)
app.add_typer(_emulate.app, name="emulate")
