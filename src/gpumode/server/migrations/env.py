"""Alembic environment: migrates the engine the server hands over (``config.attributes["engine"]``), or,
when run from the ``alembic`` command line, the database named by ``GPUMODE_DB``."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Engine

from gpumode.server import models
from gpumode.server.db import make_engine

target_metadata = models.Base.metadata


def _engine() -> Engine:
    given = context.config.attributes.get("engine")
    if isinstance(given, Engine):
        return given
    return make_engine(os.environ.get("GPUMODE_DB", "gpumode.db"))


def run_migrations_online() -> None:
    engine = _engine()
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("gpumode migrations run online only (they need the database to know its dialect)")
run_migrations_online()
