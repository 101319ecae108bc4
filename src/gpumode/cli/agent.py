"""``gpumode agent``: run the host daemon (join, report, take switch jobs)."""

from __future__ import annotations

import logging
from pathlib import Path

import typer


def agent(
    server: str = typer.Option(..., "--server", help="The gpumode server's URL, e.g. http://gpumode:8080"),
    token: str | None = typer.Option(
        None,
        "--token",
        help="A join token (gpmj_…) for the first start; later starts use the stored node token",
    ),
    root: Path = typer.Option(Path("/"), "--root", help="The host's root (an emulated host's directory)"),
    interval: float = typer.Option(
        60.0, "--interval", min=1.0, help="Report the host at least every S seconds"
    ),
    check: float = typer.Option(5.0, "--check", min=0.2, help="Look for changes every S seconds"),
    wait: float = typer.Option(
        25.0, "--wait", min=1.0, max=60.0, help="Long-poll for work S seconds at a time"
    ),
    max_backoff: float = typer.Option(30.0, "--max-backoff", min=0.1, help="Longest wait between retries"),
    no_desired: bool = typer.Option(False, "--no-desired", help="Do not re-apply the desired state at start"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug details"),
) -> None:
    """Run the gpumode agent on this host until SIGTERM/SIGINT (the current step finishes first)."""
    from gpumode.agent.config import AgentConfigError
    from gpumode.agent.daemon import Agent, AgentError, AgentOptions

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    options = AgentOptions(
        server=server,
        token=token,
        root=root,
        interval_s=interval,
        check_s=check,
        wait_s=wait,
        max_backoff_s=max_backoff,
        apply_desired=not no_desired,
    )
    try:
        code = Agent(options).run()
    except (AgentError, AgentConfigError) as exc:
        typer.echo(f"gpumode agent: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(code)
