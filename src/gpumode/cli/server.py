"""``gpumode server``: run the control plane, or ``--init`` its database."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gpumode.server.settings import Settings


def server(
    host: str | None = typer.Option(None, help="Address to listen on [default: 127.0.0.1]"),
    port: int | None = typer.Option(None, help="Port to listen on [default: 8080]"),
    db: str | None = typer.Option(None, "--db", help="SQLite file path or postgresql+psycopg:// URL"),
    config: Path | None = typer.Option(None, "--config", help="TOML or YAML settings file"),
    init: bool = typer.Option(False, "--init", help="Create/upgrade the database and print an admin token"),
    join_uses: int = typer.Option(
        1, "--join-uses", min=1, max=100_000, help="With --init: how many hosts may join with its join token"
    ),
    workers: int = typer.Option(
        1, "--workers", min=1, max=64, help="Server processes sharing the port (PostgreSQL; see docs/api.md)"
    ),
) -> None:
    """Run the gpumode server (settings: options > GPUMODE_* environment > --config file > defaults)."""
    # Imported here so `gpumode discover` and friends never pay for FastAPI and SQLAlchemy.
    from gpumode.server.settings import SettingsError, load_settings

    try:
        settings = load_settings(config, host=host, port=port, db=db)
    except SettingsError as exc:
        typer.echo(f"gpumode server: {exc}", err=True)
        raise typer.Exit(2) from exc
    if init:
        _init(settings, join_uses)
        return
    import uvicorn

    if workers > 1:
        from gpumode.server.db import DatabaseUrlError, database_url

        try:
            backend = database_url(settings.db).get_backend_name()
        except DatabaseUrlError as exc:
            typer.echo(f"gpumode server: {exc}", err=True)
            raise typer.Exit(2) from exc
        if backend != "postgresql":
            typer.echo("gpumode server: --workers needs PostgreSQL (--db postgresql+psycopg://...)", err=True)
            raise typer.Exit(2)
        # Each worker builds its own app from the same settings: stateless processes, the database between.
        os.environ[_WORKER_SETTINGS] = settings.model_dump_json()
        uvicorn.run(
            f"{__name__}:worker_app",
            factory=True,
            workers=workers,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
        )
        return
    from gpumode.server.app import create_app

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)


_WORKER_SETTINGS = "GPUMODE_WORKER_SETTINGS"


def worker_app() -> FastAPI:
    """The app of one ``--workers`` process, from the settings its parent resolved."""
    from gpumode.server.app import create_app
    from gpumode.server.settings import Settings

    return create_app(Settings.model_validate_json(os.environ[_WORKER_SETTINGS]))


def _init(settings: Settings, join_uses: int) -> None:
    from gpumode.server.bootstrap import initialise
    from gpumode.server.db import DatabaseUrlError

    try:
        result = initialise(settings, join_uses=join_uses)
    except DatabaseUrlError as exc:
        typer.echo(f"gpumode server: {exc}", err=True)
        raise typer.Exit(2) from exc
    url = settings.advertised_url
    if not result.first_time:
        typer.echo("The database was initialised before; these are additional tokens.")
    typer.echo(f"Database ready: {settings.db}")
    typer.echo("")
    typer.echo("Admin token (shown once; keep it safe):")
    typer.echo(f"  {result.admin_token}")
    typer.echo("")
    until = f"{result.join_expires_at:%Y-%m-%d %H:%M} UTC"
    hosts = "one host" if result.join_uses == 1 else f"up to {result.join_uses} hosts"
    typer.echo(f"Join {hosts} (this join token is valid until {until}; more: gpumode token join):")
    typer.echo(f"  gpumode agent --server {url} --token {result.join_token}")
    typer.echo("")
    where = f"--db {settings.db} --host {settings.host} --port {settings.port}"
    typer.echo(f"Start the server:  gpumode server {where}")
    typer.echo(f"More join tokens:  POST {url}/api/v1/join-tokens (admin)")
