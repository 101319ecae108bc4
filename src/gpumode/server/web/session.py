"""Dashboard sign-in: a signed, HTTP-only session cookie standing for an API token, and CSRF tokens.

The cookie never holds the token itself. It holds ``<token id>.<expiry>.<nonce>.<mac>``, where the MAC is an
HMAC-SHA256 keyed with the server's session key *and* the token's stored hash, and each sign-in is a row in
``web_sessions`` found by the nonce's SHA-256. So:

- a cookie cannot be forged without the session key (a leaked database alone is not enough);
- signing out, or an admin ending the session, ends the row: the old cookie stops working at once, on every
  server process, instead of living until it expires;
- revoking the token ends every session made from it (the lookup checks ``revoked``, and a deleted or
  re-issued token has another hash);
- several server processes accept each other's cookies when they share ``GPUMODE_WEB_SESSION_KEY``.

Without that variable each process draws a random key at start, so a restart signs everyone out: safe by
default, and documented in ``docs/dashboard.md``.

CSRF: every form carries a token derived from the session cookie (HMAC with a different label), checked on
every POST. SameSite=Strict already keeps other sites' forms from sending the cookie; the token covers older
browsers and same-site attackers.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpumode.server.auth import Principal, Role, authenticate, hash_secret
from gpumode.server.models import ApiToken, DashboardSession, Node
from gpumode.server.schemas import MAX_ROW_ID

COOKIE = "gpumode_session"
KEY_ENV = "GPUMODE_WEB_SESSION_KEY"
LIFETIME_S = 12 * 3600


@dataclass(frozen=True, slots=True)
class WebSession:
    """A signed-in dashboard user and the cookie value that proves it."""

    principal: Principal
    cookie: str
    csrf: str
    session_id: int  # its row in ``web_sessions``


class SignInRefused(ValueError):
    """The token cannot open a dashboard session; the message is safe to show."""


class SessionKeys:
    """The process's session key: from ``GPUMODE_WEB_SESSION_KEY`` (any string; hashed to 32 bytes) or
    random."""

    def __init__(self, key: str | None = None) -> None:
        material = key if key is not None else os.environ.get(KEY_ENV)
        self._key = hashlib.sha256(material.encode()).digest() if material else secrets.token_bytes(32)

    def _mac(self, label: str, token_hash: str, payload: str) -> str:
        key = hmac.new(self._key, f"{label}:{token_hash}".encode(), hashlib.sha256).digest()
        digest = hmac.new(key, payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def sign_in(
        self, session: Session, secret: str, *, now: float | None = None, client: str | None = None
    ) -> WebSession:
        """Check an API token and make a session for it (a row the caller commits). Node tokens cannot sign
        in: they are agents."""
        principal = authenticate(session, secret.strip()) if secret.strip() else None
        if principal is None:
            raise SignInRefused("unknown or revoked token")
        if principal.role is Role.NODE:
            raise SignInRefused("node tokens belong to agents and cannot sign in to the dashboard")
        token_hash = session.scalar(select(ApiToken.token_hash).where(ApiToken.id == principal.token_id))
        assert token_hash is not None  # authenticate just found it
        started = now if now is not None else time.time()
        expires = int(started + LIFETIME_S)
        nonce = secrets.token_urlsafe(12)
        row = DashboardSession(
            token_id=principal.token_id,
            nonce_hash=hash_secret(nonce),
            client=client[:64] if client else None,
            created_at=datetime.fromtimestamp(started, UTC),
            expires_at=datetime.fromtimestamp(expires, UTC),
        )
        session.add(row)
        session.flush()
        payload = f"{principal.token_id}.{expires}.{nonce}"
        cookie = f"{payload}.{self._mac('session', token_hash, payload)}"
        return WebSession(principal, cookie, self._mac("csrf", token_hash, cookie), row.id)

    def resume(self, session: Session, cookie: str | None, *, now: float | None = None) -> WebSession | None:
        """The session a cookie stands for, or ``None`` (absent, malformed, forged, expired, revoked)."""
        if not cookie or len(cookie) > 256:
            return None
        payload, _, mac = cookie.rpartition(".")
        parts = payload.split(".")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        if not 1 <= int(parts[0]) <= MAX_ROW_ID:  # a number no row can have: not a query for the driver
            return None
        if int(parts[1]) < (now if now is not None else time.time()):
            return None
        row = session.execute(
            select(
                ApiToken.id,
                ApiToken.name,
                ApiToken.role,
                ApiToken.token_hash,
                ApiToken.revoked,
                Node.name,
                DashboardSession.id.label("session_id"),
            )
            .join(DashboardSession, DashboardSession.token_id == ApiToken.id)
            .outerjoin(Node, Node.id == ApiToken.node_id)
            .where(
                ApiToken.id == int(parts[0]),
                DashboardSession.nonce_hash == hash_secret(parts[2]),
                DashboardSession.ended_at.is_(None),
            )
        ).first()
        if row is None or row.revoked or row.role == Role.NODE.value:
            return None
        if not hmac.compare_digest(mac, self._mac("session", row.token_hash, payload)):
            return None
        principal = Principal(token_id=row.id, name=row.name, role=Role(row.role), node=row[5])
        return WebSession(principal, cookie, self._mac("csrf", row.token_hash, cookie), row.session_id)


def end_session(session: Session, session_id: int, *, by: str, now: datetime) -> bool:
    """End a dashboard session (sign-out, or an admin): its cookie stops working at once. ``False`` when it
    had ended already or does not exist. The caller commits."""
    ended = session.execute(
        update(DashboardSession)
        .where(DashboardSession.id == session_id, DashboardSession.ended_at.is_(None))
        .values(ended_at=now, ended_by=by[:128])
        .execution_options(synchronize_session=False)
    )
    return getattr(ended, "rowcount", 0) == 1


@dataclass(frozen=True, slots=True)
class SessionInfo:
    id: int
    user: str  # the token's name
    role: str
    token_id: int
    client: str | None
    created_at: datetime
    expires_at: datetime


def open_sessions(session: Session, *, now: datetime) -> list[SessionInfo]:
    """Dashboard sessions not ended, not expired and of a token not revoked, by user then newest first."""
    rows = session.execute(
        select(DashboardSession, ApiToken.name, ApiToken.role)
        .join(ApiToken, ApiToken.id == DashboardSession.token_id)
        .where(
            DashboardSession.ended_at.is_(None),
            DashboardSession.expires_at > now,
            ApiToken.revoked.is_(False),
        )
        .order_by(ApiToken.name, DashboardSession.id.desc())
    )
    return [
        SessionInfo(s.id, name, role, s.token_id, s.client, s.created_at, s.expires_at)
        for s, name, role in rows
    ]


def csrf_ok(web: WebSession, submitted: str | None) -> bool:
    return submitted is not None and hmac.compare_digest(web.csrf, submitted)


def cookie_secure(scheme: str) -> bool:
    """``Secure`` whenever the dashboard is served over HTTPS."""
    return scheme == "https"


def plain_http_allowed(scheme: str, client_host: str | None) -> bool:
    """Over plain HTTP a sign-in is accepted only from a loopback client (the demo, an SSH tunnel): anywhere
    else the token and the cookie would cross the network in clear."""
    if scheme == "https":
        return True
    if client_host is None:
        return False
    if client_host == "localhost":
        return True
    try:
        return ipaddress.ip_address(client_host).is_loopback
    except ValueError:
        return False
