"""The server's tables. They share one :class:`~sqlalchemy.MetaData` with the embedded cloud platform's tables
(cards, profiles, aliases) so that one Alembic history covers the whole database."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, validates

from gpumode import orm

# JSONB on PostgreSQL (compact, indexable); plain JSON text on SQLite.
Json = JSON().with_variant(JSONB(), "postgresql")


# Ids are never reused (SQLite would otherwise hand a deleted row's id to the next row): an id that once meant
# one token or event must not come to mean another.
NO_ID_REUSE = orm.NO_ID_REUSE


class Base(DeclarativeBase):
    metadata = orm.metadata


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
    # The VMs the agent last reported (``gpumode.host.vms.Vm`` as JSON); the server plans switches with them.
    vms: Mapped[list[dict[str, Any]] | None] = mapped_column(Json, nullable=True)
    # :func:`vms_digest` of ``vms``, kept with them: a report compares its VMs with the stored ones in the
    # same indexed read as the fingerprint, so a server process sees VMs another process stored (0004).
    vms_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # An admin's "replace this node": until then a join under this name may take the node over without its
    # current node token (a reinstalled host that lost it); used up by that join (0006).
    replace_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    replace_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # SHA-256 of the report body the stored snapshot and VMs were taken from: a body with this digest says
    # nothing new and needs no parsing (0008). Cleared whenever either is set; the report route sets it
    # again, after both, when it stored them from one body.
    report_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # What the node's agent said about itself when it last asked for work (gpumode.wire; 0009): its gpumode
    # version (None from 0.1.0, which does not say) and protocol; the node list shows agents out of date.
    agent_version: Mapped[str | None] = mapped_column(String(32), nullable=True)
    agent_protocol: Mapped[str | None] = mapped_column(String(8), nullable=True)

    @validates("vms")
    def _digest_vms(self, _key: str, vms: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        self.vms_digest = vms_digest(vms)
        self.report_digest = None
        return vms

    @validates("snapshot")
    def _forget_report(self, _key: str, snapshot: dict[str, Any]) -> dict[str, Any]:
        self.report_digest = None
        return snapshot


def vms_digest(vms: list[dict[str, Any]] | None) -> str | None:
    """SHA-256 of the VMs' canonical JSON (``None``: no VMs reported). Migration 0004 holds a copy: change
    neither without the other."""
    if vms is None:
        return None
    return hashlib.sha256(json.dumps(vms, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class NodeGpu(Base):
    """One GPU of a node as its stored snapshot shows it: the snapshot's ``gpus`` as rows, so the fleet can
    be filtered and counted by model and mode in SQL — every GPU, also one in mode ``none`` that offers no
    card. Rewritten with each changed snapshot, in its transaction (:mod:`gpumode.server.gpu_index`)."""

    __tablename__ = "node_gpus"
    __table_args__ = (Index("ix_node_gpus_model_node_id", "model", "node_id"),)

    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True)
    address: Mapped[str] = mapped_column(String(32), primary_key=True)
    model: Mapped[str] = mapped_column(String(9))  # vendor:device, "10de:2330"
    name: Mapped[str] = mapped_column(String(512))
    mode: Mapped[str] = mapped_column(String(16), index=True)
    driver: Mapped[str | None] = mapped_column(String(512))


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


class DashboardSession(Base):
    """A dashboard sign-in, standing for an API token until it expires or is ended (sign-out, an admin)."""

    __tablename__ = "web_sessions"
    __table_args__ = NO_ID_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True)
    nonce_hash: Mapped[str] = mapped_column(String(64), unique=True)  # SHA-256 of the cookie's nonce
    client: Mapped[str | None] = mapped_column(String(64))  # the address it signed in from
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_by: Mapped[str | None] = mapped_column(String(128))


class JoinToken(Base):
    """A secret agents exchange for node tokens, ``uses`` times at most and until ``expires_at``."""

    __tablename__ = "join_tokens"
    __table_args__ = NO_ID_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    uses: Mapped[int | None] = mapped_column(Integer)  # joins it was made for (None: made before 0006)
    uses_left: Mapped[int | None] = mapped_column(Integer)  # None only before 0006, which revoked those
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


# --- switch jobs and rollouts -------------------------------------------------------------------------------

# A job is active while queued or running; at most one active job per node, enforced by the database so that
# it holds with several server processes (a partial unique index, on SQLite and PostgreSQL alike).
ACTIVE_JOB_STATES = ("queued", "running")
_ACTIVE = text("state IN ('queued', 'running')")


class Rollout(Base):
    """A switch of every node of a host group: one job per node, ``concurrency`` at once, stopped when more
    than ``max_failures`` jobs failed."""

    __tablename__ = "rollouts"
    __table_args__ = NO_ID_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    group_name: Mapped[str] = mapped_column(String(64))
    request: Mapped[dict[str, Any]] = mapped_column(Json)
    nodes: Mapped[list[str]] = mapped_column(Json)  # in the order their jobs start
    concurrency: Mapped[int] = mapped_column(Integer)
    max_failures: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), index=True)  # running | succeeded | failed | cancelled
    blocked: Mapped[list[str]] = mapped_column(Json)  # nodes skipped: another job was active on them
    created_by: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Job(Base):
    """A switch of one node: the stored plan, each step's progress, and where the job stands."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index(
            "uq_jobs_active_node",
            "node_id",
            unique=True,
            sqlite_where=_ACTIVE,
            postgresql_where=_ACTIVE,
        ),
        NO_ID_REUSE,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    node: Mapped[str] = mapped_column(String(253))  # by name too: shown without a join
    state: Mapped[str] = mapped_column(String(16), index=True)
    host_state: Mapped[str] = mapped_column(String(16))  # pending | running | done | rolled_back | failed
    request: Mapped[dict[str, Any]] = mapped_column(Json)
    plan: Mapped[dict[str, Any]] = mapped_column(Json)
    steps: Mapped[list[dict[str, Any]]] = mapped_column(Json)  # progress per step, in plan order
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text)
    # What the cloud platform did around the switch (its hold, whether released): see server/switch/hold.py.
    cloud: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True)
    rollout_id: Mapped[int | None] = mapped_column(ForeignKey("rollouts.id", ondelete="SET NULL"), index=True)
    created_by: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
