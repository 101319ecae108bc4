"""The server's tables. They share one :class:`~sqlalchemy.MetaData` with the embedded cloud platform's tables
(cards, profiles, aliases) so that one Alembic history covers the whole database."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, DateTime, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from gpumode.cloud import embedded

# JSONB on PostgreSQL (compact, indexable); plain JSON text on SQLite.
Json = JSON().with_variant(JSONB(), "postgresql")


# Ids are never reused (SQLite would otherwise hand a deleted row's id to the next row): an id that once meant
# one token or event must not come to mean another.
NO_ID_REUSE = embedded.NO_ID_REUSE


class Base(DeclarativeBase):
    metadata = embedded.metadata


class HostGroup(Base):
    __tablename__ = "host_groups"
    __table_args__ = NO_ID_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Node(Base):
    """A GPU host. ``snapshot`` is the last reported HostSnapshot (JSON form), ``fingerprint`` its
    fingerprint.
    """

    __tablename__ = "nodes"
    __table_args__ = NO_ID_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(253), unique=True)
    group_id: Mapped[int | None] = mapped_column(
        ForeignKey("host_groups.id", ondelete="SET NULL"), index=True
    )
    fingerprint: Mapped[str] = mapped_column(String(80))
    snapshot: Mapped[dict[str, Any]] = mapped_column(Json)
    mode: Mapped[str] = mapped_column(String(16), index=True)  # accel | vgpu | passthrough | none | mixed
    driver_state: Mapped[str] = mapped_column(String(16))
    gpu_count: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    changed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))  # when the snapshot last changed


class ApiToken(Base):
    """A bearer token of a person or tool (role viewer/operator/admin) or of a node agent (role node)."""

    __tablename__ = "api_tokens"
    __table_args__ = NO_ID_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_by: Mapped[str | None] = mapped_column(String(128))


class JoinToken(Base):
    """A secret an agent exchanges once (or ``uses_left`` times) for a node token."""

    __tablename__ = "join_tokens"
    __table_args__ = NO_ID_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    uses_left: Mapped[int | None] = mapped_column(Integer)  # None: unlimited
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_by: Mapped[str | None] = mapped_column(String(128))


class ModeRule(Base):
    """One level of the mode whitelist: the platform (key ""), a host group (its name), a GPU model
    ("10de:2330").
    """

    __tablename__ = "mode_rules"
    __table_args__ = (UniqueConstraint("scope", "key", name="uq_mode_rules_scope_key"), NO_ID_REUSE)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    scope: Mapped[str] = mapped_column(String(16))
    key: Mapped[str] = mapped_column(String(64))
    modes: Mapped[list[str]] = mapped_column(Json)


class Event(Base):
    """Something that happened to the fleet: a hardware change (with before/after) or an alarm."""

    __tablename__ = "events"
    __table_args__ = NO_ID_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str | None] = mapped_column(String(253), index=True)  # by name: history outlives the node
    kind: Mapped[str] = mapped_column(String(48), index=True)
    severity: Mapped[str] = mapped_column(String(16))
    target: Mapped[str | None] = mapped_column(String(128))
    message: Mapped[str] = mapped_column(Text)
    before: Mapped[Any] = mapped_column(Json, nullable=True)
    after: Mapped[Any] = mapped_column(Json, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class AuditEntry(Base):
    """One mutating API call: who, as what, did what to what, and how it ended."""

    __tablename__ = "audit_log"
    __table_args__ = NO_ID_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    actor: Mapped[str] = mapped_column(String(128))
    role: Mapped[str | None] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(128))
    target: Mapped[str | None] = mapped_column(String(255))
    status_code: Mapped[int] = mapped_column(Integer)
    detail: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
