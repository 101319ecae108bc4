"""Entry point: assembles the command groups.

Each group lives in its own module. A run imports only the module of the command it runs (``gpumode
discover`` must start fast, and the server, demo and remote groups pull in FastAPI, httpx and friends);
``gpumode --help`` and an unknown command register everything, so help and errors list every command.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import typer

# command name -> (module, how to register it)
_GROUPS: dict[str, tuple[str, Callable[[typer.Typer, object], None]]] = {}

# help lists the commands by purpose, in this order
HOST, INVENTORY, SWITCHING, ADMIN, DAEMONS = (
    "This host (no server)",
    "Fleet inventory",
    "Switching modes",
    "Fleet administration",
    "Running gpumode",
)


def _command(name: str, module: str, attr: str, panel: str) -> None:
    _GROUPS[name] = (module, lambda app, mod: app.command(name, rich_help_panel=panel)(getattr(mod, attr)))


def _subapp(name: str, module: str, panel: str, attr: str = "app") -> None:
    _GROUPS[name] = (
        module,
        lambda app, mod: app.add_typer(getattr(mod, attr), name=name, rich_help_panel=panel),
    )


_command("discover", "gpumode.cli.discover", "discover", HOST)
_command("plan", "gpumode.cli.local", "plan", HOST)
_command("apply", "gpumode.cli.local", "apply", HOST)
_command("resume", "gpumode.cli.local", "resume", HOST)
_command("rollback", "gpumode.cli.local", "rollback", HOST)
_command("assert", "gpumode.cli.local", "assert_", HOST)
_command("status", "gpumode.cli.local", "status", HOST)
_subapp("emulate", "gpumode.cli.emulate", HOST)
_subapp("journal", "gpumode.cli.journal", HOST)
_command("nodes", "gpumode.cli.remote", "nodes", INVENTORY)
_command("gpus", "gpumode.cli.remote", "gpus", INVENTORY)
_command("cards", "gpumode.cli.remote", "cards", INVENTORY)
_command("events", "gpumode.cli.remote", "events", INVENTORY)
_command("groups", "gpumode.cli.fleet_admin", "groups", INVENTORY)
_command("profiles", "gpumode.cli.fleet_admin", "profiles", INVENTORY)
_command("aliases", "gpumode.cli.fleet_admin", "aliases", INVENTORY)
_command("switch", "gpumode.cli.remote_jobs", "switch", SWITCHING)
_command("jobs", "gpumode.cli.remote_jobs", "jobs", SWITCHING)
_command("job", "gpumode.cli.remote_jobs", "job", SWITCHING)
_command("cancel", "gpumode.cli.remote_jobs", "cancel", SWITCHING)
_subapp("rollout", "gpumode.cli.rollout", SWITCHING)
_command("rollouts", "gpumode.cli.rollout", "rollouts", SWITCHING)
_subapp("modes", "gpumode.cli.remote", ADMIN, "modes_app")
_subapp("group", "gpumode.cli.fleet_admin", ADMIN, "group_app")
_subapp("card", "gpumode.cli.fleet_admin", ADMIN, "card_app")
_subapp("profile", "gpumode.cli.fleet_admin", ADMIN, "profile_app")
_subapp("alias", "gpumode.cli.fleet_admin", ADMIN, "alias_app")
_subapp("token", "gpumode.cli.remote", ADMIN, "token_app")
_subapp("server", "gpumode.cli.server", DAEMONS)
_command("agent", "gpumode.cli.agent", "agent", DAEMONS)
_command("demo", "gpumode.cli.demo", "demo", DAEMONS)


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


def command(app: typer.Typer) -> Any:
    """The click command of ``app``, its help without a ``<bool>`` placeholder after each flag (a flag takes
    no value; Typer would print its type there)."""
    root = typer.main.get_command(app)
    pending: list[Any] = [root]
    while pending:
        cmd = pending.pop()
        helper = cmd.get_help_option(cmd.context_class(cmd))  # made once per command, then cached
        for param in [*cmd.params, *([helper] if helper is not None else [])]:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        pending.extend(getattr(cmd, "commands", {}).values())
    return root


def main() -> None:
    """Console script: register only the command being run."""
    first = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    try:
        command(build_app(first))(prog_name="gpumode")
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
