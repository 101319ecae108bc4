"""switch jobs and rollouts

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

Jobs (one switch of one node: its plan and per-step progress) with a partial unique index that allows one
active job per node, rollouts (a group switched node by node), and the VMs an agent reports with its snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
ACTIVE = sa.text("state IN ('queued', 'running')")


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("vms", JSON, nullable=True))
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("group_name", sa.String(length=64), nullable=False),
        sa.Column("request", JSON, nullable=False),
        sa.Column("nodes", JSON, nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("max_failures", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("blocked", JSON, nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollouts")),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rollouts_state"), ["state"], unique=False)
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=253), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("host_state", sa.String(length=16), nullable=False),
        sa.Column("request", JSON, nullable=False),
        sa.Column("plan", JSON, nullable=False),
        sa.Column("steps", JSON, nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("rollout_id", sa.Integer(), nullable=True),
        sa.Column("created_by", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_jobs_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["rollout_id"], ["rollouts.id"], name=op.f("fk_jobs_rollout_id_rollouts"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_node_id"), ["node_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_state"), ["state"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_rollout_id"), ["rollout_id"], unique=False)
        batch_op.create_index(
            "uq_jobs_active_node", ["node_id"], unique=True, sqlite_where=ACTIVE, postgresql_where=ACTIVE
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("uq_jobs_active_node")
        batch_op.drop_index(batch_op.f("ix_jobs_rollout_id"))
        batch_op.drop_index(batch_op.f("ix_jobs_state"))
        batch_op.drop_index(batch_op.f("ix_jobs_node_id"))
    op.drop_table("jobs")
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollouts_state"))
    op.drop_table("rollouts")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("vms")
