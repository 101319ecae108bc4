"""the cloud platform's hold on a switch job

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-08

``jobs.cloud``: what the cloud platform did around a switch (OpenStack: the nova-compute service it disabled,
the instances it stopped or shelved), stored with the job so any server process — one restarted after a
crash too — can finish or undo it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cloud", JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("cloud")
