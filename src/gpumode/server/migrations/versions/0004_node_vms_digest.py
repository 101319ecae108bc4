"""a digest of each node's stored VMs

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-14

``nodes.vms_digest``: SHA-256 of the canonical JSON of ``nodes.vms``. A hardware report compares its VMs'
digest with it in the same indexed read as the fingerprint, so a server process that has seen a report body
before still notices when another process stored other VMs since. Back-filled here for stored VMs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH = 1000  # nodes read per query


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("vms_digest", sa.String(length=64), nullable=True))
    _backfill()


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("vms_digest")


def _backfill() -> None:
    conn = op.get_bind()
    nodes = sa.table(
        "nodes", sa.column("id", sa.Integer), sa.column("vms", sa.JSON), sa.column("vms_digest", sa.String)
    )
    last = 0
    while True:
        batch = conn.execute(
            sa.select(nodes.c.id, nodes.c.vms).where(nodes.c.id > last).order_by(nodes.c.id).limit(BATCH)
        ).all()
        if not batch:
            return
        for node_id, vms in batch:
            if vms is not None:
                conn.execute(nodes.update().where(nodes.c.id == node_id).values(vms_digest=_digest(vms)))
        last = batch[-1][0]


def _digest(vms: list[dict[str, Any]]) -> str:
    """As ``gpumode.server.models.vms_digest`` computes it; a copy, so this migration means the same thing in
    every later version."""
    return hashlib.sha256(json.dumps(vms, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
