"""``gpumode agent``: run the host daemon (join, report, take switch jobs)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import typer


def agent(
    server: str | None = typer.Option(
        None, "--server", help="The gpumode server's URL, e.g. https://gpumode:8080 [config `server`]"
    ),
    token: str | None = typer.Option(
        None,
        "--token",
        help="A join token (gpmj_…) for the first start; later starts use the stored node token",
    ),
    ca: Path | None = typer.Option(
        None, "--ca", help="PEM CA bundle to verify the server with [default: the system store]"
    ),
    config: Path | None = typer.Option(
        None, "--config", help="TOML settings file, e.g. /etc/gpumode/agent.toml (docs/deploy.md)"
    ),
    root: Path | None = typer.Option(None, "--root", help="The host's root [default: /]"),
    interval: float | None = typer.Option(None, "--interval", help="Report at least every S seconds [60]"),
    check: float | None = typer.Option(None, "--check", help="Look for changes every S seconds [5]"),
    wait: float | None = typer.Option(None, "--wait", help="Long-poll for work S seconds at a time [25]"),
    max_backoff: float | None = typer.Option(None, "--max-backoff", help="Longest wait between retries [30]"),
    no_desired: bool = typer.Option(False, "--no-desired", help="Do not re-apply the desired state at start"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug details"),
    show_config: bool = typer.Option(
        False, "--show-config", help="Print the effective settings (token masked) and exit"
    ),
) -> None:
    """Run the gpumode agent on this host until SIGTERM/SIGINT (the current step finishes first).

    Settings: options > GPUMODE_AGENT_* environment > --config file > defaults.
    """
    from gpumode.agent.settings import AgentSettingsError, load_agent_settings

    given: dict[str, Any] = {
        "server": server,
        "token": token,
        "ca": ca,
        "root": root,
        "interval": interval,
        "check": check,
        "wait": wait,
        "max_backoff": max_backoff,
        "apply_desired": False if no_desired else None,
        "verbose": True if verbose else None,
    }
    try:
        settings = load_agent_settings(config, **given)
    except AgentSettingsError as exc:
        typer.echo(f"gpumode agent: {exc}", err=True)
        raise typer.Exit(2) from exc
    if show_config:
        typer.echo(json.dumps(settings.shown(), indent=2))
        return

    from gpumode.agent.config import AgentConfigError
    from gpumode.agent.daemon import Agent, AgentError, AgentOptions
    from gpumode.tls import CaFileError

    logging.basicConfig(
        level=logging.DEBUG if settings.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    assert settings.server is not None  # load_agent_settings refuses a missing server
    options = AgentOptions(
        server=settings.server,
        token=settings.token,
        root=settings.root,
        interval_s=settings.interval,
        check_s=settings.check,
        wait_s=settings.wait,
        max_backoff_s=settings.max_backoff,
        apply_desired=settings.apply_desired,
        ca=settings.ca,
    )
    try:
        code = Agent(options).run()
    except (AgentError, AgentConfigError, CaFileError) as exc:
        typer.echo(f"gpumode agent: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(code)
