"""Bearer tokens: how they are made and stored, and who a request is.

A token is ``gpm<kind>_`` + 32 random bytes (url-safe base64). Only its SHA-256 is stored: a leaked database
does not leak working tokens, and because the secret is random a plain hash is enough (no salt or slow KDF
needed). Roles rank ``viewer`` < ``operator`` < ``admin``; a ``node`` token belongs to one agent and may only
act for its own node.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import Row, Select, bindparam, select, update
from sqlalchemy.orm import Session

from gpumode.server.models import ApiToken, JoinToken, Node


class Role(StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"
    NODE = "node"  # an agent; outside the viewer < operator < admin ladder


USER_ROLES = (Role.VIEWER, Role.OPERATOR, Role.ADMIN)
_RANK = {Role.VIEWER: 1, Role.OPERATOR: 2, Role.ADMIN: 3, Role.NODE: 0}


class TokenKind(StrEnum):
    USER = "u"
    NODE = "n"
    JOIN = "j"


def new_secret(kind: TokenKind) -> tuple[str, str]:
    """A fresh secret and the hash to store."""
    secret = f"gpm{kind.value}_{secrets.token_urlsafe(32)}"
    return secret, hash_secret(secret)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling."""

    token_id: int
    name: str
    role: Role
    node: str | None = None  # set for node tokens

    def at_least(self, role: Role) -> bool:
        """Whether this principal may act as ``role`` (node tokens never pass a user-role check)."""
        return self.role is not Role.NODE and _RANK[self.role] >= _RANK[role]


def bearer_secret(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


# Built once: this runs on every request, and building a statement costs more than running it on SQLite.
_BY_HASH: Select[*tuple[Any, ...]] = (
    select(ApiToken.id, ApiToken.name, ApiToken.role, ApiToken.token_hash, ApiToken.revoked, Node.name)
    .outerjoin(Node, Node.id == ApiToken.node_id)
    .where(ApiToken.token_hash == bindparam("digest"))
)


def authenticate(session: Session, secret: str) -> Principal | None:
    """The principal owning ``secret``, or ``None`` for an unknown or revoked token."""
    digest = hash_secret(secret)
    return principal_of(session.execute(_BY_HASH, {"digest": digest}).first(), digest)


def token_lookup() -> Select[*tuple[Any, ...]]:
    """The token query :func:`authenticate` runs (bound parameter ``digest``), for a hot path that adds its
    own columns and joins to it and so reads the token and what it needs in one round trip."""
    return _BY_HASH


def principal_of(row: Row[*tuple[Any, ...]] | None, digest: str) -> Principal | None:
    """The principal of a row of :func:`token_lookup` (first six columns), ``None`` if absent or revoked."""
    # The lookup is by hash, so timing says nothing about the secret; compare anyway, in constant time.
    if row is None or row.revoked or not hmac.compare_digest(row.token_hash, digest):
        return None
    return Principal(token_id=row.id, name=row.name, role=Role(row.role), node=row[5])


def create_user_token(
    session: Session, name: str, role: Role, *, created_by: str | None
) -> tuple[ApiToken, str]:
    if role not in USER_ROLES:
        raise ValueError(f"role must be one of {', '.join(USER_ROLES)}, not {role!r}")
    secret, digest = new_secret(TokenKind.USER)
    token = ApiToken(
        name=name,
        role=role.value,
        token_hash=digest,
        node_id=None,
        revoked=False,
        created_at=datetime.now(UTC),
        created_by=created_by,
    )
    session.add(token)
    session.flush()
    return token, secret


def create_node_token(session: Session, node: Node, *, created_by: str | None) -> tuple[ApiToken, str]:
    secret, digest = new_secret(TokenKind.NODE)
    token = ApiToken(
        name=f"node:{node.name}",
        role=Role.NODE.value,
        token_hash=digest,
        node_id=node.id,
        revoked=False,
        created_at=datetime.now(UTC),
        created_by=created_by,
    )
    session.add(token)
    session.flush()
    return token, secret


JOIN_TOKEN_USES = 1
JOIN_TOKEN_TTL = timedelta(hours=24)


def create_join_token(
    session: Session,
    name: str,
    *,
    uses: int = JOIN_TOKEN_USES,
    ttl: timedelta = JOIN_TOKEN_TTL,
    created_by: str | None,
    now: datetime,
) -> tuple[JoinToken, str]:
    """A join token good for ``uses`` joins until ``now + ttl``: every join token runs out, in both."""
    if uses < 1:
        raise ValueError(f"a join token is good for at least one join, not {uses}")
    if ttl <= timedelta(0):
        raise ValueError(f"a join token must expire after it is made, not {ttl} later")
    secret, digest = new_secret(TokenKind.JOIN)
    token = JoinToken(
        name=name,
        token_hash=digest,
        uses=uses,
        uses_left=uses,
        revoked=False,
        created_at=now,
        created_by=created_by,
        expires_at=now + ttl,
    )
    session.add(token)
    session.flush()
    return token, secret


class JoinRefused(Exception):
    """A join token that cannot be used; the message says why (for the audit log, not for the caller)."""


def redeem_join_token(session: Session, secret: str, *, now: datetime) -> JoinToken:
    """Use up one use of a join token; raises :class:`JoinRefused` if it cannot be used."""
    digest = hash_secret(secret)
    token = session.scalars(select(JoinToken).where(JoinToken.token_hash == digest)).first()
    if token is None or not hmac.compare_digest(token.token_hash, digest):
        raise JoinRefused("unknown join token")
    if token.revoked:
        raise JoinRefused(f"join token {token.name!r} is revoked")
    expires = token.expires_at
    # No expiry or no use count: made before migration 0006 (which revoked those); refused all the same.
    if expires is None or (expires if expires.tzinfo else expires.replace(tzinfo=UTC)) <= now:
        raise JoinRefused(f"join token {token.name!r} expired")
    # An atomic conditional decrement: two agents racing for the last use cannot both win.
    taken = session.execute(
        update(JoinToken)
        .where(JoinToken.id == token.id, JoinToken.uses_left > 0)
        .values(uses_left=JoinToken.uses_left - 1)
        .execution_options(synchronize_session=False)
    )
    if getattr(taken, "rowcount", 0) != 1:
        raise JoinRefused(f"join token {token.name!r} is used up")
    return token
