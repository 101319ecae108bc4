"""First start: create the schema, an admin token and a join token, and say how hosts join."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, func, select

from gpumode.server import db
from gpumode.server.auth import Role, TokenKind, create_user_token, new_secret
from gpumode.server.models import ApiToken, JoinToken
from gpumode.server.settings import Settings

JOIN_TOKEN_TTL = timedelta(hours=24)


@dataclass(frozen=True, slots=True)
class InitResult:
    admin_token: str
    join_token: str
    join_expires_at: datetime
    first_time: bool  # False: the database had admins already; these are additional tokens


def initialise(settings: Settings, engine: Engine | None = None) -> InitResult:
    """Migrate to ``head``; create an admin token and a 24-hour multi-use join token (shown once)."""
    engine = engine or db.make_engine(settings.db)
    db.upgrade(engine)
    sessions = db.make_sessionmaker(engine)
    now = datetime.now(UTC)
    with sessions.begin() as session:
        admins = session.scalar(
            select(func.count()).select_from(ApiToken).where(ApiToken.role == Role.ADMIN.value)
        )
        _, admin_secret = create_user_token(session, "admin", Role.ADMIN, created_by="gpumode server --init")
        join_secret, digest = new_secret(TokenKind.JOIN)
        session.add(
            JoinToken(
                name="init",
                token_hash=digest,
                uses_left=None,
                expires_at=now + JOIN_TOKEN_TTL,
                revoked=False,
                created_at=now,
                created_by="gpumode server --init",
            )
        )
    return InitResult(admin_secret, join_secret, now + JOIN_TOKEN_TTL, first_time=not admins)
