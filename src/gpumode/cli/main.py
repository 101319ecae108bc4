"""Entry point: assembles the command groups. Each group lives in its own module and imports heavy things lazily,
so ``gpumode discover`` starts fast."""

from __future__ import annotations

import typer

from gpumode.cli import agent as _agent
from gpumode.cli import demo as _demo
from gpumode.cli import discover as _discover
from gpumode.cli import emulate as _emulate
from gpumode.cli import local as _local
from gpumode.cli import remote as _remote
from gpumode.cli import server as _server

app = typer.Typer(
    name="gpumode",
    help="Move GPU hosts, and each GPU in them, between accel, vGPU and passthrough modes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command("discover")(_discover.discover)
app.add_typer(_emulate.app, name="emulate")
app.command("plan")(_local.plan)
app.command("apply")(_local.apply)
app.command("assert")(_local.assert_)
app.command("status")(_local.status)
app.command("server")(_server.server)
app.command("agent")(_agent.agent)
_remote.register(app)
app.command("demo")(_demo.demo)
