"""the digest of the report body each node's stored state was taken from

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

``nodes.report_digest``: SHA-256 of the report body whose snapshot and VMs are stored. The report's one
indexed read returns it, so a body that is byte for byte the one already stored is answered without being
parsed again, by every server process and right after a restart. Setting the snapshot or the VMs any other
way clears it (``gpumode.server.models.Node``). Not back-filled: nodes start without one, and their next
report stores it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("report_digest", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("report_digest")
