"""the version and protocol of each node's agent

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

``nodes.agent_version`` and ``nodes.agent_protocol``: what the node's agent said about itself when it last
asked for work (``gpumode.wire``). Unknown (NULL) until then: the server learns it from the next work poll.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("agent_version", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("agent_protocol", sa.String(length=8), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("agent_protocol")
        batch_op.drop_column("agent_version")
