"""Host groups and lost cards on the dashboard: everyone sees the groups; operators create them, move hosts
in and out, delete them, and release a lost card from its host's page (the same functions as the API,
:mod:`gpumode.server.fleet_ops`)."""

from __future__ import annotations

import re

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from gpumode.cloud.base import CardStatus
from gpumode.server import audit, fleet_ops
from gpumode.server.auth import Role
from gpumode.server.deps import SessionDep
from gpumode.server.models import Node
from gpumode.server.schemas import NAME_PATTERN, RowId
from gpumode.server.state import ServerState
from gpumode.server.web.access import WebUser, one, read_form, require_role
from gpumode.server.web.render import page
from gpumode.server.web.session import WebSession

router = APIRouter(include_in_schema=False)
UI = "/ui"
GROUPS = f"{UI}/groups"


def _render(
    request: Request, web: WebSession, session: Session, *, error: str | None = None, status_code: int = 200
) -> HTMLResponse:
    members = fleet_ops.group_members(session)
    nodes = list(session.scalars(select(Node.name).order_by(Node.name)))
    return page(request, web, "groups.html", status_code, nav="groups", members=members, nodes=nodes,
                error=error)  # fmt: skip


@router.get(GROUPS, response_class=HTMLResponse)
def groups(request: Request, web: WebUser, session: SessionDep) -> HTMLResponse:
    return _render(request, web, session)


@router.post(GROUPS, response_model=None)
async def change_group(request: Request, web: WebUser) -> Response:
    require_role(request, web, Role.OPERATOR)
    fields = await read_form(request, web)
    state: ServerState = request.app.state.gpumode
    return await run_in_threadpool(_change, request, web, state, one(fields, "action") or "",
                                   one(fields, "group") or "", one(fields, "node"))  # fmt: skip


def _change(
    request: Request, web: WebSession, state: ServerState, action: str, name: str, node: str | None
) -> Response:
    """``create`` a group, ``assign`` a node to it, ``remove`` a node from it, or ``delete`` it."""
    with state.sessions() as session:
        try:
            if not re.match(NAME_PATTERN, name):
                raise fleet_ops.FleetOpError(422, "a group name is letters, digits, '_', '.', ':', '-'")
            current = fleet_ops.group_members(session).get(name)
            if action == "create":
                if current is not None:
                    raise fleet_ops.FleetOpError(409, f"host group {name!r} exists")
                members = fleet_ops.set_group(session, name, [])
            elif action in ("assign", "remove"):
                if current is None:
                    raise fleet_ops.FleetOpError(404, f"no host group named {name!r}")
                if not node:
                    raise fleet_ops.FleetOpError(422, "choose a host")
                wanted = [*current, node] if action == "assign" else [n for n in current if n != node]
                members = fleet_ops.set_group(session, name, wanted)
            elif action == "delete":
                fleet_ops.delete_group(session, name)
                members = []
            else:
                raise fleet_ops.FleetOpError(422, f"unknown action {action!r}")
        except fleet_ops.FleetOpError as exc:
            session.rollback()
            return _render(request, web, session, error=str(exc), status_code=exc.status)
        detail = "deleted" if action == "delete" else f"members: {', '.join(members) or '-'}"
        audit.commit_audited(request, session, target=f"group:{name}", detail=detail)
    return RedirectResponse(GROUPS, status_code=status.HTTP_303_SEE_OTHER)


@router.post(UI + "/cards/{card_id}/release", response_model=None)
async def release(request: Request, card_id: RowId, web: WebUser) -> Response:
    require_role(request, web, Role.OPERATOR)
    await read_form(request, web)  # the CSRF check
    state: ServerState = request.app.state.gpumode
    return await run_in_threadpool(_release, request, state, card_id)


def _release(request: Request, state: ServerState, card_id: int) -> Response:
    with state.sessions() as session:
        platform = state.platform_factory(session)
        card = platform.get_card(card_id)
        if card is None or card.status is not CardStatus.LOST:
            raise HTTPException(status.HTTP_409_CONFLICT, f"card {card_id} is not a lost card")
        fleet_ops.release_lost(session, platform, card)
        audit.commit_audited(request, session, target=f"card:{card_id}", detail="lost card released")
        node = card.node
    return RedirectResponse(f"{UI}/nodes/{node}", status_code=status.HTTP_303_SEE_OTHER)
