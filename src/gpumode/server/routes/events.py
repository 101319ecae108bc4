"""Events (hardware changes, alarms) for viewers; the audit log for admins."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import select

from gpumode.server import audit
from gpumode.server.deps import Admin, SessionDep, Viewer
from gpumode.server.models import AuditEntry, Event
from gpumode.server.schemas import AuditOut, EventOut, RowId

router = APIRouter(tags=["events"])
Limit = Annotated[int, Query(ge=1, le=1000)]


@router.get(
    "/events",
    response_model=list[EventOut],
    summary="Newest first; filter by node, kind (or a kind "
    "prefix ending in '.', e.g. 'hardware.'), severity; page with before_id",
)
def list_events(
    _: Viewer,
    session: SessionDep,
    node: str | None = None,
    kind: str | None = None,
    severity: str | None = None,
    before_id: RowId | None = None,
    limit: Limit = 100,
) -> list[Event]:
    query = select(Event).order_by(Event.id.desc()).limit(limit)
    if node is not None:
        query = query.where(Event.node == node)
    if kind is not None:
        query = query.where(
            Event.kind.startswith(kind, autoescape=True) if kind.endswith(".") else Event.kind == kind
        )
    if severity is not None:
        query = query.where(Event.severity == severity)
    if before_id is not None:
        query = query.where(Event.id < before_id)
    return list(session.scalars(query))


@router.get("/audit", response_model=list[AuditOut], summary="Newest first; page with before_id")
def list_audit(
    _: Admin,
    session: SessionDep,
    actor: str | None = None,
    before_id: RowId | None = None,
    limit: Limit = 100,
    people: Annotated[bool, Query(description="only what people did (not agents, not joins)")] = False,
) -> list[AuditEntry]:
    return audit.list_entries(session, limit=limit, before_id=before_id, actor=actor, people=people)
