"""Fleet rollouts in the dashboard: the list, one rollout followed live, and starting one on a host group
with its dry run first.

Starting one goes through the switch service, as ``POST /api/v1/groups/{group}/switch`` does
(:mod:`gpumode.server.switch.service`), planned with the server's cloud platform. The preview plans one
page of members at a time (planning is a millisecond or two a host, and a group can hold thousands) and shows
figures for the whole group read in SQL (:mod:`gpumode.server.web.group_figures`); confirming plans every
member again in :func:`service.start_rollout`, as the API does, and stores exactly the request previewed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from gpumode.cloud.base import CloudPlatform
from gpumode.domain import Plan, SwitchRequest, VmPolicy
from gpumode.errors import GpumodeError
from gpumode.server import whitelist
from gpumode.server.auth import Role
from gpumode.server.deps import SessionDep, StateDep
from gpumode.server.models import HostGroup, Job, Node, Rollout
from gpumode.server.schemas import RolloutIn, RowId
from gpumode.server.state import ServerState
from gpumode.server.switch import planning, rollouts, service
from gpumode.server.switch.errors import JobError, NotFound, refusal_detail
from gpumode.server.web import group_figures, live
from gpumode.server.web.access import WebUser, one, read_form, require_role
from gpumode.server.web.queries import PAGE_SIZE
from gpumode.server.web.render import page
from gpumode.server.web.session import WebSession
from gpumode.server.web.switch import caller

router = APIRouter(include_in_schema=False)
UI = "/ui"
FIELDS = (
    "group",
    "mode",
    "vgpu_type",
    "vgpu_count",
    "profile",
    "passthrough_alias",
    "vm_policy",
    "concurrency",
    "max_failures",
)
ACTIVE = ("queued", "running")
PREVIEW_PAGE = PAGE_SIZE  # members planned a page; 50 plans take well under the 200 ms a page may
CONFIRM_NAMED = 50  # refused members listed when a confirm is refused; the rest are counted


# --- the list -----------------------------------------------------------------------------------------------


@router.get(f"{UI}/rollouts", response_class=HTMLResponse)
def rollout_list(
    request: Request,
    web: WebUser,
    session: SessionDep,
    page_no: Annotated[int, Query(alias="page", ge=1, le=1_000_000)] = 1,
) -> HTMLResponse:
    """Newest first, a page at a time; each row's progress is counted in SQL over that page's jobs."""
    total = session.scalar(select(func.count(Rollout.id))) or 0
    pages = max(1, -(-total // PAGE_SIZE))
    current = min(page_no, pages)
    found = list(
        session.scalars(
            select(Rollout).order_by(Rollout.id.desc()).limit(PAGE_SIZE).offset((current - 1) * PAGE_SIZE)
        )
    )
    progress: dict[int, dict[str, int]] = {r.id: {} for r in found}
    if found:
        for rollout_id, state, n in session.execute(
            select(Job.rollout_id, Job.state, func.count())
            .where(Job.rollout_id.in_(list(progress)))
            .group_by(Job.rollout_id, Job.state)
        ):
            if rollout_id is not None:  # it is not: the query asks for these rollouts (for the type checker)
                progress[rollout_id][state] = n
    return page(
        request,
        web,
        "rollouts.html",
        nav="rollouts",
        rollouts=found,
        progress=progress,
        page_no=current,
        pages=pages,
        total=total,
    )


# --- starting one: form, dry run, confirm -------------------------------------------------------------------


def _choices(session: Session, state: ServerState) -> dict[str, Any]:
    """Groups with their sizes, and what a request may name: profiles, vGPU types, aliases, VM policies."""
    sizes = dict(
        session.execute(
            select(HostGroup.name, func.count(Node.id))
            .outerjoin(Node, Node.group_id == HostGroup.id)
            .group_by(HostGroup.name)
            .order_by(HostGroup.name)
        ).all()
    )
    platform = state.platform_factory(session)
    catalog = planning.catalog()
    types = sorted({t.name for model in catalog.models.values() for t in model.vgpu_types})
    return {
        "groups": sizes,
        "modes": ["accel", "vgpu", "passthrough"],
        "profiles": platform.list_profiles(),
        "vgpu_types": types,
        "aliases": platform.list_aliases(),
        "vm_policies": [p.value for p in VmPolicy],
    }


def _form_page(
    request: Request,
    web: WebSession,
    session: Session,
    state: ServerState,
    values: dict[str, Any],
    error: dict[str, Any] | None,
    status_code: int = 200,
) -> HTMLResponse:
    return page(
        request,
        web,
        "rollout_form.html",
        status_code,
        nav="rollouts",
        c=_choices(session, state),
        values=values,
        error=error,
    )


@router.get(f"{UI}/rollouts/new", response_class=HTMLResponse)  # before /rollouts/{id}
def rollout_form(
    request: Request,
    web: WebUser,
    session: SessionDep,
    state: StateDep,
    group: Annotated[str | None, Query(max_length=64)] = None,
) -> HTMLResponse:
    require_role(request, web, Role.OPERATOR)
    return _form_page(request, web, session, state, {"group": group} if group else {}, None)


def _values(fields: dict[str, list[str]]) -> dict[str, Any]:
    """The form as the API's body: blank fields are absent."""
    values: dict[str, Any] = {}
    for key in FIELDS:
        raw = (fields.get(key) or [""])[0].strip()
        if raw:
            values[key] = raw
    return values


def _validate(values: dict[str, Any]) -> tuple[str, RolloutIn]:
    group = values.get("group")
    if not group:
        raise JobError("invalid_option", "group: choose the host group to roll out to")
    try:
        return group, RolloutIn.model_validate({k: v for k, v in values.items() if k != "group"})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise JobError("invalid_option", problems) from exc


@dataclass(frozen=True, slots=True)
class Resolved:
    """A rollout request read from the form: its group and the engine's request, checked as the API checks
    them before planning anything."""

    group: str
    group_id: int
    body: RolloutIn
    request: SwitchRequest
    platform: CloudPlatform


def _resolve(session: Session, state: ServerState, values: dict[str, Any]) -> Resolved:
    group, body = _validate(values)
    platform = state.platform_factory(session)
    gid = group_figures.group_id(session, group)
    request = planning.to_request(body, platform)
    return Resolved(group, gid, body, request, platform)


@dataclass(frozen=True, slots=True)
class Member:
    """One row of the preview: a member's dry run, or why it may not be switched."""

    node: str
    plan: Plan | None
    refused: str | None = None


def _page_no(fields: dict[str, list[str]]) -> int:
    """The preview page asked for; anything but a plain page number reads as the first page."""
    raw = one(fields, "page") or "1"
    return max(1, int(raw)) if raw.isdigit() and len(raw) < 8 else 1


@router.post(f"{UI}/rollouts/preview", response_class=HTMLResponse)
async def preview(request: Request, web: WebUser, state: StateDep) -> HTMLResponse:
    """The dry run of one page of members, with figures for the whole group and a button that stores
    exactly this request."""
    require_role(request, web, Role.OPERATOR)
    fields = await read_form(request, web)
    return await run_in_threadpool(_preview, request, web, state, _values(fields), _page_no(fields))


def _preview(
    request: Request, web: WebSession, state: ServerState, values: dict[str, Any], page_no: int
) -> HTMLResponse:
    with state.sessions() as session:
        try:
            resolved = _resolve(session, state, values)
            mode = resolved.request.mode
            figures = group_figures.figures(
                session, resolved.group_id, resolved.group, mode, whitelist.load(session)
            )
            if figures.members == 0:
                raise JobError("empty_group", f"host group {resolved.group!r} has no nodes")
        except GpumodeError as exc:
            return _form_page(request, web, session, state, values, refusal_detail(exc), 422)
        rules = whitelist.rules(session)
        pages = max(1, -(-figures.members // PREVIEW_PAGE))
        current = min(page_no, pages)
        members: list[Member] = []
        for node in group_figures.member_page(session, resolved.group_id, current, PREVIEW_PAGE):
            # each member as plan_all plans it for the API's dry run: the same function, rules and platform
            try:
                plan = planning.plan_for_node(session, node, resolved.request, rules, resolved.platform)
                members.append(Member(node.name, plan))
            except GpumodeError as exc:
                members.append(Member(node.name, None, exc.message))
        session.rollback()
        refused_here = sum(1 for m in members if m.refused)
        plans = [m.plan for m in members if m.plan is not None]
        return page(
            request,
            web,
            "rollout_preview.html",
            422 if refused_here or figures.refused else 200,
            nav="rollouts",
            group=resolved.group,
            body=resolved.body,
            target_mode=resolved.request.mode.value,
            figures=figures,
            members=members,
            refused_here=refused_here,
            vms_stopping=sum(len(p.impact.vms_stopped) for p in plans),
            reboots=sum(1 for p in plans if p.impact.reboot_required),
            page_no=current,
            pages=pages,
            first=(current - 1) * PREVIEW_PAGE + 1,
            values=values,
        )


def _refusals(exc: rollouts.GroupNotPlannable) -> dict[str, Any]:
    """A whole-group refusal as a list of members and reasons, not hundreds of names run together."""
    lines = list(exc.refused.items())
    members = len(lines) + len(exc.plannable)
    return {
        **refusal_detail(exc),
        "message": f"{len(lines)} of {members} hosts may not be switched; nothing was started",
        "refused": lines[:CONFIRM_NAMED],
        "refused_more": max(0, len(lines) - CONFIRM_NAMED),
    }


@router.post(f"{UI}/rollouts", response_model=None)
async def confirm(request: Request, web: WebUser, state: StateDep) -> Response:
    require_role(request, web, Role.OPERATOR)
    values = _values(await read_form(request, web))
    return await run_in_threadpool(_confirm, request, web, state, values)


def _confirm(request: Request, web: WebSession, state: ServerState, values: dict[str, Any]) -> Response:
    """Every member planned again by the switch service, as ``POST /api/v1/groups/{group}/switch`` does: one
    that may not be switched refuses the whole rollout, and the form says which and why."""
    with state.sessions() as session:
        try:
            group, body = _validate(values)
            rollout = service.start_rollout(caller(request, web, state, session), group, body)
        except rollouts.GroupNotPlannable as exc:
            return _form_page(request, web, session, state, values, _refusals(exc), 422)
        except GpumodeError as exc:
            return _form_page(request, web, session, state, values, refusal_detail(exc), 422)
    return RedirectResponse(f"{UI}/rollouts/{rollout.id}", status_code=status.HTTP_303_SEE_OTHER)


# --- one rollout, live --------------------------------------------------------------------------------------


def _rollout(session: Session, rollout_id: int) -> Rollout:
    try:
        return rollouts.get(session, rollout_id)
    except NotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc


def rollout_view(session: Session, rollout: Rollout) -> dict[str, Any]:
    """What the rollout page shows and its event stream sends: each member's job and state as the API's
    :func:`rollouts.out` tells them, read without the jobs' plans and steps (a whole group's would be
    megabytes, read again at every tick of the stream)."""
    own = {
        node: (job_id, state, error)
        for job_id, node, state, error in session.execute(
            select(Job.id, Job.node, Job.state, Job.error).where(Job.rollout_id == rollout.id)
        )
    }
    blocked = dict(b.split(": ", 1) for b in rollout.blocked if ": " in b)
    counts = {"succeeded": 0, "active": 0, "pending": 0, "failed": 0}  # failed: ended otherwise, or blocked
    nodes = []
    for name in rollout.nodes:
        if name in own:
            job_id, state, error = own[name]
        elif name in blocked:
            job_id, state, error = None, "blocked", blocked[name]
        else:
            job_id, state, error = None, "pending", None
        nodes.append({"node": name, "job": job_id, "state": state, "error": error})
        counts["active" if state in ACTIVE else state if state in ("succeeded", "pending") else "failed"] += 1
    return {
        "id": rollout.id,
        "state": rollout.state,
        "failures": counts["failed"],
        "max_failures": rollout.max_failures,
        "finished_at": rollout.finished_at,
        "nodes": nodes,
        "counts": counts,
        "active": rollout.state == rollouts.RolloutState.RUNNING.value or counts["active"] > 0,
    }


@router.get(UI + "/rollouts/{rollout_id}", response_class=HTMLResponse)
def rollout_page(request: Request, rollout_id: RowId, web: WebUser, session: SessionDep) -> HTMLResponse:
    rollout = _rollout(session, rollout_id)
    return page(
        request, web, "rollout.html", nav="rollouts", rollout=rollout, view=rollout_view(session, rollout)
    )


@router.get(UI + "/rollouts/{rollout_id}/stream")
def rollout_stream(
    request: Request, rollout_id: RowId, web: WebUser, session: SessionDep, state: StateDep
) -> StreamingResponse:
    """Server-sent events: the rollout view each time a member's job moves, until nothing is left running."""
    _rollout(session, rollout_id)  # 404 before the stream starts
    return live.stream(request, lambda: _view(state, rollout_id), over=lambda data: not data["active"])


def _view(state: ServerState, rollout_id: int) -> dict[str, Any]:
    with state.sessions() as session:
        return rollout_view(session, _rollout(session, rollout_id))
