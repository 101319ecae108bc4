"""Entry point: assembles the command groups.

Each group lives in its own module. A run imports only the module of the command it runs (``gpumode
discover`` must start fast, and the server, demo and remote groups pull in FastAPI, httpx and friends);
``gpumode --help`` and an unknown command register everything, so help and errors list every command.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import typer

# command name -> (module, how to register it)
_GROUPS: dict[str, tuple[str, Callable[[typer.Typer, object], None]]] = {}


def _command(name: str, module: str, attr: str) -> None:
    _GROUPS[name] = (module, lambda app, mod: app.command(name)(getattr(mod, attr)))


def _subapp(name: str, module: str, attr: str = "app") -> None:
    _GROUPS[name] = (module, lambda app, mod: app.add_typer(getattr(mod, attr), name=name))


_command("discover", "gpumode.cli.discover", "discover")
_subapp("emulate", "gpumode.cli.emulate")
_command("plan", "gpumode.cli.local", "plan")
_command("apply", "gpumode.cli.local", "apply")
_command("resume", "gpumode.cli.local", "resume")
_command("rollback", "gpumode.cli.local", "rollback")
_command("assert", "gpumode.cli.local", "assert_")
_command("status", "gpumode.cli.local", "status")
_subapp("journal", "gpumode.cli.journal")
_command("server", "gpumode.cli.server", "server")
_command("agent", "gpumode.cli.agent", "agent")
_command("demo", "gpumode.cli.demo", "demo")
_command("nodes", "gpumode.cli.remote", "nodes")
_command("gpus", "gpumode.cli.remote", "gpus")
_command("cards", "gpumode.cli.remote", "cards")
_command("events", "gpumode.cli.remote", "events")
_subapp("modes", "gpumode.cli.remote", "modes_app")
_subapp("token", "gpumode.cli.remote", "token_app")
_command("switch", "gpumode.cli.remote_jobs", "switch")
_command("jobs", "gpumode.cli.remote_jobs", "jobs")
_command("job", "gpumode.cli.remote_jobs", "job")
_command("cancel", "gpumode.cli.remote_jobs", "cancel")
_subapp("rollout", "gpumode.cli.rollout")
_command("rollouts", "gpumode.cli.rollout", "rollouts")


def _root() -> None:
    """Move GPU hosts, and each GPU in them, between accel, vGPU and passthrough modes."""


def build_app(only: str | None = None) -> typer.Typer:
    """The Typer app with every command, or with just ``only`` when it names one."""
    app = typer.Typer(
        name="gpumode",
        help="Move GPU hosts, and each GPU in them, between accel, vGPU and passthrough modes.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    # a callback keeps the app a group even when only one command is registered
    app.callback()(_root)
    names = [only] if only in _GROUPS else list(_GROUPS)
    for name in names:
        module, register = _GROUPS[name]
        register(app, importlib.import_module(module))
    return app


def main() -> None:
    """Console script: register only the command being run."""
    first = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    build_app(first)()


def __getattr__(name: str) -> typer.Typer:
    # `from gpumode.cli.main import app` (tests, `python -m`) gets the full app, built on first use.
    if name == "app":
        app = build_app()
        globals()["app"] = app
        return app
    raise AttributeError(name)
