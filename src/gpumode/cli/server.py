"""``gpumode server``: run the control plane, ``--init`` its database, ``migrate`` it, ``config show``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gpumode.server.settings import Settings

app = typer.Typer(
    help="Run the gpumode server (settings: options > GPUMODE_* environment > --config file > defaults).",
    invoke_without_command=True,
    no_args_is_help=False,
)
config_app = typer.Typer(help="The server's configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")

ConfigOpt = typer.Option(None, "--config", help="TOML or YAML settings file (docs/deploy.md lists every key)")
DbOpt = typer.Option(None, "--db", help="SQLite file path or postgresql+psycopg:// URL")


@app.callback()
def server(
    ctx: typer.Context,
    host: str | None = typer.Option(None, help="Address to listen on [default: 127.0.0.1]"),
    port: int | None = typer.Option(None, help="Port to listen on [default: 8080]"),
    db: str | None = DbOpt,
    config: Path | None = ConfigOpt,
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="PEM certificate: serve HTTPS"),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert"),
    forwarded_allow_ips: str | None = typer.Option(
        None,
        "--forwarded-allow-ips",
        help="Reverse proxies (comma-separated addresses/CIDRs) whose X-Forwarded-* headers are believed "
        "[default: none]",
    ),
    init: bool = typer.Option(False, "--init", help="Create/upgrade the database and print an admin token"),
    join_uses: int = typer.Option(
        1, "--join-uses", min=1, max=100_000, help="With --init: how many hosts may join with its join token"
    ),
    workers: int = typer.Option(
        1, "--workers", min=1, max=64, help="Server processes sharing the port (PostgreSQL; see docs/api.md)"
    ),
) -> None:
    """Run the gpumode server (settings: options > GPUMODE_* environment > --config file > defaults)."""
    given: dict[str, Any] = {
        "host": host,
        "port": port,
        "db": db,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "forwarded_allow_ips": forwarded_allow_ips,
    }
    if ctx.invoked_subcommand is not None:
        # `gpumode server --config F migrate`: the subcommand builds the settings from these too
        ctx.obj = {"config": config, **given}
        return
    settings = _settings(config, given)
    if init:
        _init(settings, join_uses)
        return
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
    _check_schema(settings)
    import uvicorn

    if workers > 1:
        # Each worker builds its own app from the same settings: stateless processes, the database between.
        os.environ[_WORKER_SETTINGS] = settings.model_dump_json()
        uvicorn.run(f"{__name__}:worker_app", factory=True, workers=workers, **uvicorn_options(settings))
        return
    from gpumode.server.app import create_app

    uvicorn.run(create_app(settings), **uvicorn_options(settings))


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Where and how uvicorn serves: TLS when a certificate is set; forwarded headers believed only from the
    configured proxies (uvicorn's own default would believe 127.0.0.1)."""
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "proxy_headers": bool(settings.forwarded_allow_ips),
        "forwarded_allow_ips": settings.forwarded_allow_ips or [],
    }
    if settings.tls_cert is not None and settings.tls_key is not None:
        options["ssl_certfile"] = str(settings.tls_cert)
        options["ssl_keyfile"] = str(settings.tls_key)
    return options


@app.command()
def migrate(ctx: typer.Context, db: str | None = DbOpt, config: Path | None = ConfigOpt) -> None:
    """Upgrade the database's schema to this gpumode's (refuses a schema newer than it knows)."""
    settings = _settings(*_inherit(ctx, db=db, config=config))
    from gpumode.server import db as database

    engine = _engine(settings)
    try:
        before = database.current_revision(engine)
        database.upgrade(engine)
        after = database.current_revision(engine)
    except database.SchemaError as exc:
        typer.echo(f"gpumode server migrate: {exc}", err=True)
        raise typer.Exit(2) from exc
    finally:
        engine.dispose()
    if before == after:
        typer.echo(f"Database {settings.db} is up to date (revision {after}).")
    else:
        typer.echo(f"Database {settings.db} migrated from revision {before or '(empty)'} to {after}.")


@config_app.command("show")
def config_show(
    ctx: typer.Context,
    db: str | None = DbOpt,
    config: Path | None = ConfigOpt,
    as_json: bool = typer.Option(False, "--json", help="JSON instead of TOML"),
) -> None:
    """Print the effective configuration (every key, after file, environment and options) with secrets
    masked."""
    from gpumode.server.settings import effective

    settings = _settings(*_inherit(ctx, db=db, config=config))
    data = effective(settings)
    typer.echo(json.dumps(data, indent=2) if as_json else to_toml(data))


def to_toml(data: dict[str, Any]) -> str:
    """A TOML rendering of plain settings data: top-level keys under ``[server]``, tables after (a key whose
    value is ``None`` is shown commented out: it is not set)."""
    lines = ["[server]"]
    tables: list[tuple[str, dict[str, Any]]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(_toml_line(key, value))
    for name, table in tables:
        lines += ["", f"[{name}]"] + [_toml_line(k, v) for k, v in table.items()]
    return "\n".join(lines)


def _toml_line(key: str, value: Any) -> str:
    if value is None:
        return f"# {key} = (not set)"
    return f"{key} = {json.dumps(value)}"  # JSON strings, numbers, booleans and lists are valid TOML


def _inherit(ctx: typer.Context, **mine: Any) -> tuple[Path | None, dict[str, Any]]:
    """A subcommand's settings sources: its own options over those given before it (``server --db X``)."""
    parent: dict[str, Any] = dict(ctx.obj or {})
    config = mine.pop("config") or parent.pop("config", None)
    parent.pop("config", None)
    return config, {**parent, **{k: v for k, v in mine.items() if v is not None}}


def _settings(config: Path | None, given: dict[str, Any]) -> Settings:
    # Imported here so `gpumode discover` and friends never pay for FastAPI and SQLAlchemy.
    from gpumode.server.settings import SettingsError, load_settings

    try:
        return load_settings(config, **given)
    except SettingsError as exc:
        typer.echo(f"gpumode server: {exc}", err=True)
        raise typer.Exit(2) from exc


def _engine(settings: Settings) -> Any:
    from gpumode.server.db import DatabaseUrlError, make_engine

    try:
        return make_engine(settings.db)
    except DatabaseUrlError as exc:
        typer.echo(f"gpumode server: {exc}", err=True)
        raise typer.Exit(2) from exc


def _check_schema(settings: Settings) -> None:
    """Refuse to start on a database of another schema, before the first request finds out."""
    from gpumode.server.db import SchemaError, check_schema, database_url

    url = database_url(settings.db)
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).exists():
        typer.echo(
            f"gpumode server: no database at {url.database}: run `gpumode server --init` to create one",
            err=True,
        )
        raise typer.Exit(2)
    engine = _engine(settings)
    try:
        check_schema(engine)
    except SchemaError as exc:
        typer.echo(f"gpumode server: {exc}", err=True)
        raise typer.Exit(2) from exc
    finally:
        engine.dispose()


_WORKER_SETTINGS = "GPUMODE_WORKER_SETTINGS"


def worker_app() -> FastAPI:
    """The app of one ``--workers`` process, from the settings its parent resolved."""
    from gpumode.server.app import create_app
    from gpumode.server.settings import Settings

    return create_app(Settings.model_validate_json(os.environ[_WORKER_SETTINGS]))


def _init(settings: Settings, join_uses: int) -> None:
    from gpumode.server.bootstrap import initialise
    from gpumode.server.db import DatabaseUrlError, SchemaError

    try:
        result = initialise(settings, join_uses=join_uses)
    except (DatabaseUrlError, SchemaError) as exc:
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
    ca = " --ca CA.pem" if settings.tls else ""
    typer.echo(f"  gpumode agent --server {url} --token {result.join_token}{ca}")
    typer.echo("")
    where = f"--db {settings.db} --host {settings.host} --port {settings.port}"
    if settings.tls:
        where += f" --tls-cert {settings.tls_cert} --tls-key {settings.tls_key}"
    typer.echo(f"Start the server:  gpumode server {where}")
    typer.echo("More join tokens:  gpumode token join --uses N --expires-in S")
