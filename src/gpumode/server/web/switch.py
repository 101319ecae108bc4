"""Switching a host from the dashboard: the form, the dry-run preview, the confirmation, and the job page
that follows the job live (server-sent events) until it ends.

Everything goes through the switch service, as ``POST /api/v1/nodes/{name}/switch`` does
(:mod:`gpumode.server.switch.service`): the preview is the dry-run plan, and confirming stores exactly that
request.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from gpumode.domain import HostSnapshot, Mode, VmPolicy
from gpumode.errors import GpumodeError
from gpumode.modes import policy
from gpumode.server import audit, whitelist
from gpumode.server.auth import Role
from gpumode.server.deps import SessionDep, StateDep
from gpumode.server.models import HostGroup, Job, Node
from gpumode.server.schemas import RowId, SwitchIn
from gpumode.server.state import ServerState
from gpumode.server.switch import planning, service
from gpumode.server.switch.codec import plan_json
from gpumode.server.switch.errors import ActiveJobExists, JobConflict, JobError, NotFound, refusal_detail
from gpumode.server.switch.service import Caller
from gpumode.server.switch.states import JobState
from gpumode.server.switch.store import get_job
from gpumode.server.web import live
from gpumode.server.web.access import WebUser, read_form, require_role
from gpumode.server.web.progress import step_progress
from gpumode.server.web.render import duration, page
from gpumode.server.web.session import WebSession

router = APIRouter(include_in_schema=False)
UI = "/ui"
FIELDS = ("mode", "vgpu_type", "vgpu_count", "profile", "passthrough_alias", "vm_policy")


# --- the form -----------------------------------------------------------------------------------------------


def _choices(session: Session, state: ServerState, node: Node) -> dict[str, Any]:
    """What the form offers for this node: each mode (and why it is disabled), vGPU types, profiles and
    aliases."""
    snap = HostSnapshot.from_dict(node.snapshot)
    rules = whitelist.rules(session)
    group_name = session.scalar(select(HostGroup.name).where(HostGroup.id == node.group_id))
    named = any(g.name == group_name for g in rules.groups)
    group = rules.group(node.name, group_name if named else None)
    catalog = planning.catalog()
    reasons: dict[Mode, list[str]] = {m: [] for m in policy.REQUESTABLE}
    gpus = []
    types: set[str] = set()
    for gpu in snap.gpus:
        allowed = policy.allowed_modes(snap, gpu, catalog, rules, group)
        gpus.append({"gpu": gpu, "allowed": {m.value: r for m, r in allowed.items()}})
        for mode, reason in allowed.items():
            if reason is not None:
                reasons[mode].append(f"{gpu.address}: {reason}")
        offer = policy.vgpu_offer(snap, gpu, catalog)
        if offer is not None:
            types.update(t.name for t in offer.types)
    # a host with no GPU offers no mode: say so rather than an empty "not allowed:"
    nothing = None if snap.gpus else f"{node.name} reported no NVIDIA GPU, so there is nothing to switch"
    modes = []
    for mode in policy.REQUESTABLE:
        blocked = reasons[mode] if snap.gpus else [nothing]
        every = len(reasons[mode]) == len(snap.gpus)
        modes.append({"mode": mode.value, "disabled": every, "reasons": blocked})
    platform = state.platform_factory(session)
    return {
        "nothing_to_switch": nothing,
        "any_mode": any(not m["disabled"] for m in modes),
        "modes": modes,
        "gpus": gpus,
        "vgpu_types": sorted(types),
        "profiles": platform.list_profiles(),
        "aliases": platform.list_aliases(),
        "vm_policies": [p.value for p in VmPolicy],
        "vms": node.vms or [],
    }


def _node(session: Session, name: str) -> Node:
    try:
        return planning.find_node(session, name)
    except NotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc


@router.get(UI + "/nodes/{name}/switch", response_class=HTMLResponse)
def switch_form(
    request: Request, name: str, web: WebUser, session: SessionDep, state: StateDep
) -> HTMLResponse:
    node = _node(session, name)
    return _form_page(request, web, session, state, node, {}, None)


def _form_page(
    request: Request,
    web: WebSession,
    session: Session,
    state: ServerState,
    node: Node,
    values: dict[str, Any],
    error: dict[str, Any] | None,
    status_code: int = 200,
) -> HTMLResponse:
    return page(
        request,
        web,
        "switch.html",
        status_code,
        nav="fleet",
        node=node,
        c=_choices(session, state, node),
        values=values,
        error=error,
    )


def _values(fields: dict[str, list[str]]) -> dict[str, Any]:
    """The form as the API's body: blank fields are absent, ``gpus`` a list."""
    values: dict[str, Any] = {}
    for key in FIELDS:
        raw = (fields.get(key) or [""])[0].strip()
        if raw:
            values[key] = raw
    values["gpus"] = [g for g in fields.get("gpus", []) if g.strip()]
    return values


def _validate(values: dict[str, Any]) -> SwitchIn:
    try:
        return SwitchIn.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise JobError("invalid_option", problems) from exc


def caller(request: Request, web: WebSession, state: ServerState, session: Session) -> Caller:
    """A dashboard call into the switch service: audited like the API, waking agents the same way."""
    return Caller(
        session, state.platform_factory(session), audit.Trail(request), state.wakeups, web.principal.name
    )


@router.post(UI + "/nodes/{name}/switch/preview", response_class=HTMLResponse)
async def preview(request: Request, name: str, web: WebUser, state: StateDep) -> HTMLResponse:
    """The dry run: the plan and its impact, with a button that stores exactly this request."""
    require_role(request, web, Role.OPERATOR)
    values = _values(await read_form(request, web))
    return await run_in_threadpool(_preview, request, web, state, name, values)


def _preview(
    request: Request, web: WebSession, state: ServerState, name: str, values: dict[str, Any]
) -> HTMLResponse:
    with state.sessions() as session:
        node = _node(session, name)
        try:
            plan = service.preview_switch(caller(request, web, state, session), name, _validate(values))
        except GpumodeError as exc:
            return _form_page(request, web, session, state, node, values, refusal_detail(exc), 422)
        return page(request, web, "preview.html", nav="fleet", node=node, plan=plan_json(plan), values=values)


@router.post(UI + "/nodes/{name}/switch", response_model=None)
async def confirm(request: Request, name: str, web: WebUser, state: StateDep) -> Response:
    require_role(request, web, Role.OPERATOR)
    values = _values(await read_form(request, web))
    return await run_in_threadpool(_confirm, request, web, state, name, values)


def _confirm(
    request: Request, web: WebSession, state: ServerState, name: str, values: dict[str, Any]
) -> Response:
    with state.sessions() as session:
        node = _node(session, name)
        try:
            job = service.start_switch(caller(request, web, state, session), name, _validate(values))
        except ActiveJobExists as exc:
            error = {**refusal_detail(exc), "job": exc.job_id}
            return _form_page(request, web, session, state, node, values, error, 409)
        except GpumodeError as exc:
            return _form_page(request, web, session, state, node, values, refusal_detail(exc), 422)
    return RedirectResponse(f"{UI}/jobs/{job.id}", status_code=status.HTTP_303_SEE_OTHER)


# --- the job ------------------------------------------------------------------------------------------------


def _job(session: Session, job_id: int) -> Job:
    try:
        return get_job(session, job_id)
    except NotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc


def job_view(job: Job) -> dict[str, Any]:
    """What the job page shows and the event stream sends: the same dict, so the page and its live updates
    cannot disagree."""
    return {
        "id": job.id,
        "node": job.node,
        "state": job.state,
        "host_state": job.host_state,
        "active": JobState(job.state).active,
        "cancel_requested": job.cancel_requested,
        "error": job.error,
        "duration": duration(job.started_at or job.created_at, job.finished_at),
        "steps": [
            {
                "id": s["id"],
                "state": s["state"],
                "duration": duration(s.get("started_at"), s.get("finished_at")),
                "error": s.get("error"),
                "note": s.get("note"),
            }
            for s in job.steps
        ],
        "progress": step_progress(job.steps),
    }


def cards_view(session: Session, state: ServerState, node: str) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "kind": c.kind.value,
            "gpu": c.gpu,
            "device": c.device,
            "vgpu_type": c.vgpu_type,
            "status": c.status.value,
            "holder": c.holder,
        }
        for c in state.platform_factory(session).list_cards(node=node)
    ]


@router.get(UI + "/jobs/{job_id}", response_class=HTMLResponse)
def job_page(
    request: Request, job_id: RowId, web: WebUser, session: SessionDep, state: StateDep
) -> HTMLResponse:
    job = _job(session, job_id)
    return page(
        request,
        web,
        "job.html",
        nav="fleet",
        job=job,
        view=job_view(job),
        cards=cards_view(session, state, job.node),
    )


@router.get(UI + "/jobs/{job_id}/stream")
def job_stream(
    request: Request, job_id: RowId, web: WebUser, session: SessionDep, state: StateDep
) -> StreamingResponse:
    """Server-sent events: the job view (and the node's cards) each time they change, until the job ends."""
    _job(session, job_id)  # 404 before the stream starts
    return live.stream(
        request,
        lambda: _snapshot(state, job_id),
        over=lambda data: not data["job"]["active"],
        key=_without_durations,
    )


def _snapshot(state: ServerState, job_id: int) -> dict[str, Any]:
    with state.sessions() as session:
        job = _job(session, job_id)
        return {"job": job_view(job), "cards": cards_view(session, state, job.node)}


def _without_durations(data: dict[str, Any]) -> str:
    """Durations of running steps tick; compare without them so only real changes are sent."""
    job = data["job"]
    steps = [{**s, "duration": None} for s in job["steps"]]
    return json.dumps({**data, "job": {**job, "duration": None, "steps": steps}}, sort_keys=True)


@router.post(UI + "/jobs/{job_id}/cancel")
async def cancel(request: Request, job_id: RowId, web: WebUser, state: StateDep) -> RedirectResponse:
    """Cancel a queued job, or have a running one rolled back by its agent."""
    require_role(request, web, Role.OPERATOR)
    await read_form(request, web)
    await run_in_threadpool(_cancel, request, web, state, job_id)
    return RedirectResponse(f"{UI}/jobs/{job_id}", status_code=status.HTTP_303_SEE_OTHER)


def _cancel(request: Request, web: WebSession, state: ServerState, job_id: int) -> None:
    with state.sessions() as session:
        try:
            service.cancel_job(caller(request, web, state, session), job_id)
        except NotFound as exc:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
        except JobConflict as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
