"""Databases for tests: a SQLite file, or a private schema in PostgreSQL's shared ``test`` database.

Every PostgreSQL test gets its own schema, dropped afterwards, so runs (and CI on a shared server) never see
each other's rows. Where PostgreSQL is not reachable its tests are skipped — unless
``GPUMODE_REQUIRE_POSTGRES=1`` (``scripts/test.sh`` sets it), where that is a failure: a server that is down
must not quietly halve the database tests.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from gpumode.server import db

PG_BASE = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@contextmanager
def postgres_schema(prefix: str) -> Iterator[str]:
    """The URL of a fresh schema named ``<prefix>_<random>``, dropped on exit."""
    admin = create_engine(PG_BASE, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 2})
    try:
        with admin.connect():
            pass
    except Exception as exc:
        admin.dispose()
        message = f"PostgreSQL is not reachable on 127.0.0.1:5432 ({exc.__class__.__name__})"
        if os.environ.get("GPUMODE_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"{message}, and GPUMODE_REQUIRE_POSTGRES=1", pytrace=False)
        pytest.skip(message)
    schema = f"{prefix}_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{PG_BASE}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@contextmanager
def empty_database(kind: str, tmp_path: Path, prefix: str) -> Iterator[Engine]:
    """An engine on a database without any schema: ``kind`` is ``sqlite`` or ``postgresql``."""
    if kind == "sqlite":
        engine = db.make_engine(str(tmp_path / "gpumode.db"))
        try:
            yield engine
        finally:
            engine.dispose()
        return
    with postgres_schema(prefix) as url:
        engine = db.make_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()
