"""Switch requests, jobs and rollouts (operators act, viewers read): each route parses its input, calls the
switch service (:mod:`gpumode.server.switch.service`) and renders the answer. The agent's side is in
:mod:`gpumode.server.routes.work`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from gpumode.cloud.base import CloudPlatform
from gpumode.errors import GpumodeError, Kind
from gpumode.server import audit
from gpumode.server.auth import Principal, Role
from gpumode.server.deps import (
    Operator,
    PlatformDep,
    PrincipalDep,
    SessionDep,
    Viewer,
    node_access,
    server_state,
)
from gpumode.server.models import Job, Rollout
from gpumode.server.responses import errors
from gpumode.server.schemas import (
    DryRunOut,
    JobOut,
    RolloutDryRunOut,
    RolloutIn,
    RolloutOut,
    RowId,
    SwitchIn,
)
from gpumode.server.switch import rollouts, service
from gpumode.server.switch.codec import plan_json
from gpumode.server.switch.errors import ActiveJobExists, refusal_detail
from gpumode.server.switch.service import Caller
from gpumode.server.switch.store import get_job as stored_job

router = APIRouter(tags=["jobs"])


def job_out(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "node": job.node,
        "state": job.state,
        "host_state": job.host_state,
        "request": job.request,
        "plan": job.plan,
        "steps": job.steps,
        "rollout": job.rollout_id,
        "cloud": job.cloud,
        "cancel_requested": job.cancel_requested,
        "error": job.error,
        "created_by": job.created_by,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "updated_at": job.updated_at,
    }


@contextmanager
def refusals() -> Iterator[None]:
    """The switch service's refusals as HTTP answers, the same for every route, by the kind of their code
    (:data:`gpumode.errors.CODES`): bad input is 422 (code, message and choices), an unknown node, job,
    group or rollout 404, a node or job in the wrong state for it 409."""
    try:
        yield
    except GpumodeError as exc:
        raise HTTPException(_STATUS[exc.kind], _body(exc)) from exc


_STATUS = {
    Kind.BAD_INPUT: status.HTTP_422_UNPROCESSABLE_CONTENT,
    Kind.NOT_FOUND: status.HTTP_404_NOT_FOUND,
    Kind.CONFLICT: status.HTTP_409_CONFLICT,
    Kind.FAILED: status.HTTP_500_INTERNAL_SERVER_ERROR,
}


def _body(exc: GpumodeError) -> Any:
    if isinstance(exc, ActiveJobExists):
        return {"code": exc.code, "message": exc.message, "job": exc.job_id}
    if exc.kind is Kind.BAD_INPUT:
        return refusal_detail(exc)
    return exc.message


def _caller(request: Request, session: Session, platform: CloudPlatform, principal: Principal) -> Caller:
    return Caller(session, platform, audit.Trail(request), server_state(request).wakeups, principal.name)


@router.post(
    "/nodes/{name}/switch",
    responses=errors(404, 409),
    response_model=JobOut | DryRunOut,
    status_code=status.HTTP_201_CREATED,
    summary="Switch a node (or some of its GPUs) to a mode: a job, or with dry_run=true only its plan",
)
def switch(
    name: str,
    body: SwitchIn,
    principal: Operator,
    request: Request,
    session: SessionDep,
    platform: PlatformDep,
    dry_run: bool = False,
) -> Any:
    caller = _caller(request, session, platform, principal)
    with refusals():
        if dry_run:
            plan = service.preview_switch(caller, name, body)
            return _dry(DryRunOut(node=name, plan=plan_json(plan)))
        return job_out(service.start_switch(caller, name, body))


def _dry(body: BaseModel) -> JSONResponse:
    """A dry run answers 200, not a creation's 201."""
    return JSONResponse(body.model_dump(mode="json"), status_code=status.HTTP_200_OK)


@router.get("/jobs", response_model=list[JobOut])
def list_jobs(
    _: Viewer,
    session: SessionDep,
    node: str | None = None,
    state: str | None = None,
    rollout: RowId | None = None,
    before_id: RowId | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[dict[str, Any]]:
    query = select(Job).order_by(Job.id.desc()).limit(limit)
    if node is not None:
        query = query.where(Job.node == node)
    if state is not None:
        query = query.where(Job.state == state)
    if rollout is not None:
        query = query.where(Job.rollout_id == rollout)
    if before_id is not None:
        query = query.where(Job.id < before_id)
    return [job_out(j) for j in session.scalars(query)]


@router.get("/jobs/{job_id}", responses=errors(404), response_model=JobOut)
def get_job(job_id: RowId, principal: PrincipalDep, session: SessionDep) -> dict[str, Any]:
    with refusals():
        job = stored_job(session, job_id)
    node_access(principal, job.node, users_need=Role.VIEWER)
    return job_out(job)


@router.post(
    "/jobs/{job_id}/cancel",
    responses=errors(404, 409),
    response_model=JobOut,
    summary="Cancel a job (a running one is rolled back)",
)
def cancel_job(
    job_id: RowId, principal: Operator, request: Request, session: SessionDep, platform: PlatformDep
) -> dict[str, Any]:
    with refusals():
        return job_out(service.cancel_job(_caller(request, session, platform, principal), job_id))


# --- rollouts -----------------------------------------------------------------------------------------------


@router.post(
    "/groups/{group}/switch",
    responses=errors(404, 409),
    response_model=RolloutOut | RolloutDryRunOut,
    status_code=status.HTTP_201_CREATED,
    summary="Switch every node of a host group: one job per node, N at once, within a failure budget",
)
def switch_group(
    group: str,
    body: RolloutIn,
    principal: Operator,
    request: Request,
    session: SessionDep,
    platform: PlatformDep,
    dry_run: bool = False,
) -> Any:
    caller = _caller(request, session, platform, principal)
    with refusals():
        if dry_run:
            plans = service.preview_rollout(caller, group, body)
            return _dry(RolloutDryRunOut(group=group, plans={n: plan_json(p) for n, p in plans.items()}))
        return rollouts.out(session, service.start_rollout(caller, group, body))


@router.get("/rollouts", response_model=list[RolloutOut])
def list_rollouts(
    _: Viewer, session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> list[dict[str, Any]]:
    found = session.scalars(select(Rollout).order_by(Rollout.id.desc()).limit(limit))
    return [rollouts.out(session, r) for r in found]


@router.get("/rollouts/{rollout_id}", responses=errors(404), response_model=RolloutOut)
def get_rollout(rollout_id: RowId, _: Viewer, session: SessionDep) -> dict[str, Any]:
    with refusals():
        return rollouts.out(session, rollouts.get(session, rollout_id))


@router.post(
    "/rollouts/{rollout_id}/cancel",
    responses=errors(404, 409),
    response_model=RolloutOut,
    summary="Start no more jobs and cancel the queued ones; running jobs finish",
)
def cancel_rollout(
    rollout_id: RowId, principal: Operator, request: Request, session: SessionDep, platform: PlatformDep
) -> dict[str, Any]:
    with refusals():
        rollout = service.cancel_rollout(_caller(request, session, platform, principal), rollout_id)
    return rollouts.out(session, rollout)
