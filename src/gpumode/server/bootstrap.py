"""First start: create the schema, an admin token and a join token, and say how hosts join."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine, func, select

from gpumode.server import db
from gpumode.server.auth import JOIN_TOKEN_TTL, JOIN_TOKEN_USES, Role, create_join_token, create_user_token
from gpumode.server.models import ApiToken
from gpumode.server.settings import Settings


@dataclass(frozen=True, slots=True)
class InitResult:
    admin_token: str
    join_token: str
    join_expires_at: datetime
    join_uses: int
    first_time: bool  # False: the database had admins already; these are additional tokens


def initialise(
    settings: Settings, engine: Engine | None = None, *, join_uses: int = JOIN_TOKEN_USES
) -> InitResult:
    """Migrate to ``head``; create an admin token and a join token good for ``join_uses`` joins within 24
    hours, like any other join token (both shown once)."""
    engine = engine or db.make_engine(settings.db)
    db.upgrade(engine)
    sessions = db.make_sessionmaker(engine)
    now = datetime.now(UTC)
    with sessions.begin() as session:
        admins = session.scalar(
            select(func.count()).select_from(ApiToken).where(ApiToken.role == Role.ADMIN.value)
        )
        _, admin_secret = create_user_token(session, "admin", Role.ADMIN, created_by="gpumode server --init")
        _, join_secret = create_join_token(
            session, "init", uses=join_uses, created_by="gpumode server --init", now=now
        )
    return InitResult(admin_secret, join_secret, now + JOIN_TOKEN_TTL, join_uses, first_time=not admins)
