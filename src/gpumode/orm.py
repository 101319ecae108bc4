"""The one SQLAlchemy :data:`metadata` every gpumode table is declared on (the server's models and the
embedded cloud platform's cards), so one Alembic history covers them all; and the time helpers its columns
need. Imports nothing of gpumode's, like :mod:`gpumode.domain`."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import MetaData

# Named constraints keep migrations identical on SQLite and PostgreSQL.
metadata = MetaData(
    naming_convention={
        "ix": "ix_%(column_0_label)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


# Ids are never reused, even on SQLite (which would otherwise hand a deleted row's id to the next row): a
# scheduler that remembers card 7, or an id that once meant one token or event, must never mean another.
NO_ID_REUSE = {"sqlite_autoincrement": True}


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """SQLite hands timestamps back naive; they were stored as UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
