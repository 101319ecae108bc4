"""Database engine, sessions and migrations.

SQLite (a file, WAL journal so readers never wait for the one writer) is the default; PostgreSQL is reached
through ``postgresql+psycopg://``. The schema comes only from Alembic (``upgrade head``), never from
``create_all``, so a database made by one version of gpumode upgrades cleanly to the next.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker


class DatabaseUrlError(ValueError):
    """The database setting is neither a SQLAlchemy URL we support nor a file path."""


SUPPORTED_DRIVERS = ("sqlite", "postgresql")


def database_url(value: str) -> URL:
    """A SQLAlchemy URL from a URL or a plain file path (SQLite); PostgreSQL always through psycopg 3."""
    if "://" not in value:
        return URL.create("sqlite", database=str(Path(value).expanduser().resolve()))
    try:
        url = make_url(value)
    except ArgumentError as exc:
        raise DatabaseUrlError(f"not a database URL: {value!r}") from exc
    backend = url.get_backend_name()
    if backend not in SUPPORTED_DRIVERS:
        raise DatabaseUrlError(f"unsupported database {backend!r} in {value!r}: use sqlite or postgresql")
    if backend == "postgresql" and url.drivername != "postgresql+psycopg":
        url = url.set(drivername="postgresql+psycopg")
    return url


def make_engine(value: str, *, pool_size: int = 10) -> Engine:
    url = database_url(value)
    if url.get_backend_name() == "sqlite":
        in_memory = url.database in (None, "", ":memory:")
        if not in_memory and url.database:
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        # A file database gets a pool as large as PostgreSQL's: connections beyond the pool are closed on
        # return, and opening one (WAL pragmas included) costs more than a hot-path report.
        pool = {} if in_memory else {"pool_size": pool_size, "max_overflow": pool_size}
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=False)


def make_inline_reader(engine: Engine) -> Engine | None:
    """For a SQLite file, an engine of its own for reads made on the event loop (the report's fast path):
    a local indexed read that, in WAL mode, never waits for a writer. Its connections give up on a locked
    database after 50 ms rather than 30 s, so a rare lock (recovery after a crash) cannot stall the loop
    (the caller falls back to a worker thread). ``None`` for PostgreSQL, where a read is a network round trip,
    and for an in-memory database, which another engine would not see."""
    url = engine.url
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    # One connection: only the event loop's thread uses it.
    return create_engine(url, connect_args={"check_same_thread": False, "timeout": 0.05}, pool_size=1)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints, fast commits
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(engine: Engine | None = None) -> Config:
    """The packaged Alembic configuration; with ``engine``, migrations run on its connections."""
    ini = files("gpumode.server") / "alembic.ini"
    config = Config(str(ini))
    config.set_main_option("script_location", "gpumode.server:migrations")
    if engine is not None:
        config.attributes["engine"] = engine
    return config


class SchemaError(RuntimeError):
    """The database's schema is not the one this gpumode runs on; the message says what to do."""


def head_revision() -> str:
    """The newest schema revision this gpumode knows."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "gpumode ships at least one migration"
    return head


def _known(revision: str) -> bool:
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    try:
        return ScriptDirectory.from_config(alembic_config()).get_revision(revision) is not None
    except CommandError:
        return False


def _refuse_newer(current: str | None) -> None:
    if current is not None and not _known(current):
        raise SchemaError(
            f"the database's schema is at revision {current}, newer than this gpumode knows "
            f"(newest: {head_revision()}): run a gpumode at least as new as the one that migrated it"
        )


def upgrade(engine: Engine) -> None:
    """Bring the schema to the newest revision (idempotent); refuses a schema newer than this gpumode."""
    _refuse_newer(current_revision(engine))
    command.upgrade(alembic_config(engine), "head")


def check_schema(engine: Engine) -> None:
    """Refuse to serve a database whose schema is not exactly this gpumode's (the server's start)."""
    current = current_revision(engine)
    _refuse_newer(current)
    head = head_revision()
    if current != head:
        where = f"at revision {current}" if current else "empty (no gpumode schema)"
        raise SchemaError(
            f"the database is {where}; this gpumode needs revision {head}: "
            "run `gpumode server migrate` (same --db/--config) first"
            + ("" if current else ", or `gpumode server --init` for a new one")
        )


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
