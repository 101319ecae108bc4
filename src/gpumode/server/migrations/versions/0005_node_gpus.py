"""each node's GPUs as rows

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-15

``node_gpus``: one row per GPU of each node's stored snapshot (address, vendor:device, name, mode, driver),
indexed by model and by mode, so the dashboard filters by model and counts GPUs per mode in SQL, GPUs that
offer no card included. Back-filled here from the stored snapshots; the sync keeps it current.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH = 500  # snapshots read per query: a vGPU host's snapshot is large, the whole fleet's would not fit
NVIDIA = 0x10DE


def upgrade() -> None:
    op.create_table(
        "node_gpus",
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("address", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=9), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("driver", sa.String(length=512), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_node_gpus_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("node_id", "address", name=op.f("pk_node_gpus")),
    )
    with op.batch_alter_table("node_gpus", schema=None) as batch_op:
        batch_op.create_index("ix_node_gpus_model_node_id", ["model", "node_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_node_gpus_mode"), ["mode"], unique=False)
    _backfill()


def _backfill() -> None:
    """Rows for every stored snapshot, read a batch of nodes at a time by id. The rows are derived here
    rather than by the server's code so that this migration means the same thing in every later version."""
    conn = op.get_bind()
    nodes = sa.table("nodes", sa.column("id", sa.Integer), sa.column("snapshot", sa.JSON))
    gpus = sa.table(
        "node_gpus",
        *(sa.column(c) for c in ("node_id", "address", "model", "name", "mode", "driver")),
    )
    last = 0
    while True:
        batch = conn.execute(
            sa.select(nodes.c.id, nodes.c.snapshot).where(nodes.c.id > last).order_by(nodes.c.id).limit(BATCH)
        ).all()
        if not batch:
            return
        rows = [row for node_id, snapshot in batch for row in _rows(node_id, snapshot)]
        if rows:
            conn.execute(sa.insert(gpus), rows)
        last = batch[-1][0]


def _rows(node_id: int, snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    vendors = {fn["address"]: fn.get("vendor", NVIDIA) for fn in snapshot.get("functions", [])}
    return [
        {
            "node_id": node_id,
            "address": gpu["address"],
            "model": f"{vendors.get(gpu['address'], NVIDIA):04x}:{gpu['device']:04x}",
            "name": gpu.get("name") or "",
            "mode": gpu["mode"],
            "driver": gpu.get("driver"),
        }
        for gpu in snapshot.get("gpus", [])
    ]


def downgrade() -> None:
    with op.batch_alter_table("node_gpus", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_node_gpus_mode"))
        batch_op.drop_index("ix_node_gpus_model_node_id")
    op.drop_table("node_gpus")
