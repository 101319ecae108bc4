"""The audit log: every mutating API call, who made it, and how it ended.

A successful change writes its entry in its own transaction (:func:`commit_audited`), so the change and its
record land together or not at all. Everything else — a 401, a 403, a 404, a 422, a crash — is written
afterwards by :class:`AuditMiddleware` from the response status, so refused calls are on record too. An
unchanged hardware report changes nothing and is not recorded (:func:`skip`): agents report every few seconds
and the fast path writes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpumode.server.auth import USER_ROLES, Principal
from gpumode.server.models import AuditEntry

log = logging.getLogger(__name__)

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_DONE = "audit_done"
_PRINCIPAL = "principal"


def record(
    session: Session,
    *,
    actor: str,
    role: str | None,
    action: str,
    target: str | None,
    status_code: int,
    detail: str | None = None,
) -> None:
    session.add(
        AuditEntry(
            actor=actor[:128],
            role=role,
            action=action[:128],
            target=(target or None) and target[:255],
            status_code=status_code,
            detail=detail,
            created_at=datetime.now(UTC),
        )
    )


def action_of(scope: Scope) -> str:
    """``METHOD /route/{template}``: groups calls by endpoint rather than by the ids in their path."""
    path: str = scope.get("path", "?")
    route = scope.get("route")
    template = getattr(route, "path_format", None)
    if template:
        # Routers may be mounted under a prefix the route does not know: recover it from the concrete path.
        try:
            concrete = template.format(**scope.get("path_params", {}))
        except (KeyError, IndexError, ValueError):
            concrete = None
        if concrete and path.endswith(concrete):
            return f"{scope.get('method', '?')} {path[: len(path) - len(concrete)]}{template}"
    return f"{scope.get('method', '?')} {path}"


def set_principal(request: Request, principal: Principal) -> None:
    request.state.principal = principal


def commit_audited(
    request: Request,
    session: Session,
    *,
    target: str | None,
    status_code: int = 200,
    detail: str | None = None,
) -> None:
    """Add the audit entry for this call to ``session`` and commit it with the change it describes."""
    principal: Principal | None = getattr(request.state, _PRINCIPAL, None)
    record(
        session,
        actor=principal.name if principal else "anonymous",
        role=principal.role.value if principal else None,
        action=action_of(request.scope),
        target=target,
        status_code=status_code,
        detail=detail,
    )
    session.commit()
    setattr(request.state, _DONE, True)


@dataclass(frozen=True, slots=True)
class Trail:
    """Where one call's audit entry goes: its request names who made it and which endpoint. The switch
    service takes one, so every way into a switch writes its entry with the change it describes."""

    request: Request

    def commit(
        self, session: Session, *, target: str, status_code: int = 200, detail: str | None = None
    ) -> None:
        commit_audited(self.request, session, target=target, status_code=status_code, detail=detail)

    def skip(self) -> None:
        skip(self.request)


def skip(request: Request) -> None:
    """This mutating call changed nothing (an unchanged report): no audit entry, no write."""
    setattr(request.state, _DONE, True)


PEOPLE = tuple(role.value for role in USER_ROLES)  # a person's token or session; not an agent's, not a join


def list_entries(
    session: Session,
    *,
    limit: int,
    before_id: int | None = None,
    actor: str | None = None,
    people: bool = False,
) -> list[AuditEntry]:
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    if actor is not None:
        query = query.where(AuditEntry.actor == actor)
    if people:
        query = query.where(AuditEntry.role.in_(PEOPLE))
    return list(session.scalars(query))


class AuditMiddleware:
    """Records the mutating ``/api/`` calls that did not record themselves (refusals, errors)."""

    def __init__(self, app: ASGIApp, sessions: Callable[[], sessionmaker[Session]]) -> None:
        self.app = app
        self.sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in MUTATING
            or not scope["path"].startswith("/api/")
        ):
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if not state.get(_DONE):
                await run_in_threadpool(self._write, scope, state, status)

    def _write(self, scope: Scope, state: dict[str, Any], status: int) -> None:
        principal: Principal | None = state.get(_PRINCIPAL)
        try:
            with self.sessions()() as session:
                record(
                    session,
                    actor=principal.name if principal else "anonymous",
                    role=principal.role.value if principal else None,
                    action=action_of(scope),
                    target=scope.get("path"),
                    status_code=status,
                )
                session.commit()
        except Exception:  # the response is already sent; losing an entry must not turn into a crash
            log.exception("could not write audit entry for %s %s", scope.get("method"), scope.get("path"))
