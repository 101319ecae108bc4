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
_command("assert", "gpumode.cli.local", "assert_")
_command("status", "gpumode.cli.local", "status")
_subapp("journal", "gpumode.cli.journal")
_subapp("server", "gpumode.cli.server")
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


# top-level module of an optional dependency -> the extra that installs it (pyproject.toml)
EXTRAS = {
    "fastapi": "server",
    "starlette": "server",
    "uvicorn": "server",
    "sqlalchemy": "server",
    "alembic": "server",
    "pydantic": "server",
    "pydantic_settings": "server",
    "tenacity": "agent",
    "prometheus_client": "server",
    "psycopg": "server",
    "jinja2": "server",
    "libvirt": "libvirt",
    "keystoneauth1": "openstack",
    "placement": "openstack",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The one line for a missing optional dependency, or ``None`` when ``exc`` is not one (a real bug)."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return f"gpumode: this command needs the {top!r} package: pip install 'gpumode[{extra}]'"


def _print_version(value: bool) -> None:
    if value:
        from gpumode import __version__

        typer.echo(f"gpumode {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
) -> None:
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
    try:
        build_app(first)()
    except ModuleNotFoundError as exc:
        line = missing_extra(exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        raise SystemExit(2) from None


def __getattr__(name: str) -> typer.Typer:
    # `from gpumode.cli.main import app` (tests, `python -m`) gets the full app, built on first use.
    if name == "app":
        app = build_app()
        globals()["app"] = app
        return app
    raise AttributeError(name)
