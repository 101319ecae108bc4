"""re-joining needs proof; join tokens always carry a use count and an expiry

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

``nodes.replace_until`` / ``nodes.replace_by``: an admin's "replace this node" (until when, and who said so);
while it stands, a join under the node's name may take it over without the node's current token.
``join_tokens.uses``: how many joins the token was made for (``uses_left`` counts down from it).

Join tokens made before this revision without a use count or without an expiry are revoked: every join
token now runs out, and an unlimited one would keep the power to join hosts forever.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("replace_until", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("replace_by", sa.String(length=128), nullable=True))
    with op.batch_alter_table("join_tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("uses", sa.Integer(), nullable=True))
    tokens = sa.table(
        "join_tokens",
        sa.column("uses", sa.Integer),
        sa.column("uses_left", sa.Integer),
        sa.column("expires_at", sa.DateTime(timezone=True)),
        sa.column("revoked", sa.Boolean),
    )
    op.execute(sa.update(tokens).values(uses=tokens.c.uses_left))
    op.execute(
        sa.update(tokens)
        .where(sa.or_(tokens.c.uses_left.is_(None), tokens.c.expires_at.is_(None)))
        .values(revoked=True)
    )


def downgrade() -> None:
    with op.batch_alter_table("join_tokens", schema=None) as batch_op:
        batch_op.drop_column("uses")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("replace_by")
        batch_op.drop_column("replace_until")
