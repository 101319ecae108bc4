"""Switch requests, jobs and rollouts (operators act, viewers read). The agent's side is in
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

from gpumode.server import audit, jobs, rollouts, whitelist
from gpumode.server.auth import Role
from gpumode.server.deps import Operator, PlatformDep, PrincipalDep, SessionDep, Viewer, node_access
from gpumode.server.models import Job, Rollout
from gpumode.server.routes import work
from gpumode.server.schemas import (
    DryRunOut,
    JobOut,
    RolloutDryRunOut,
    RolloutIn,
    RolloutOut,
    SwitchIn,
)

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
    """The job service's refusals as HTTP answers, the same for every route: an unknown node, job, group or
    rollout is 404, a request that may not be planned 422 (with its code and choices), a job or rollout in
    the wrong state for it 409."""
    try:
        yield
    except jobs.NotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
    except jobs.JobError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, exc.detail()) from exc
    except jobs.JobConflict as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc


@router.post(
    "/nodes/{name}/switch",
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
    with refusals():
        node = jobs.find_node(session, name)
        switch_request = jobs.to_request(jobs.SwitchOptions.from_body(body), platform)
        plan = jobs.plan_for_node(session, node, switch_request, whitelist.load(session), platform)
    if dry_run:
        return _dry(request, session, DryRunOut(node=name, plan=jobs.plan_json(plan)))
    try:
        job = jobs.create_job(session, node, plan, created_by=principal.name)
    except jobs.ActiveJobExists as exc:
        session.rollback()
        raise HTTPException(status.HTTP_409_CONFLICT, {"message": str(exc), "job": exc.job_id}) from exc
    audit.commit_audited(
        request, session, target=f"node:{name}", status_code=201, detail=f"job {job.id}: {job.request}"
    )
    work.notifier(request).notify(name)
    return job_out(job)


def _dry(request: Request, session: Session, body: BaseModel) -> JSONResponse:
    """A dry run stores nothing, so it leaves no audit trace either, and answers 200, not a creation's 201."""
    session.rollback()
    audit.skip(request)
    return JSONResponse(body.model_dump(mode="json"), status_code=status.HTTP_200_OK)


@router.get("/jobs", response_model=list[JobOut])
def list_jobs(
    _: Viewer,
    session: SessionDep,
    node: str | None = None,
    state: str | None = None,
    rollout: int | None = None,
    before_id: int | None = None,
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


@router.get("/jobs/{job_id}", response_model=JobOut)
def get_job(job_id: int, principal: PrincipalDep, session: SessionDep) -> dict[str, Any]:
    with refusals():
        job = jobs.get_job(session, job_id)
    node_access(principal, job.node, users_need=Role.VIEWER)
    return job_out(job)


@router.post(
    "/jobs/{job_id}/cancel", response_model=JobOut, summary="Cancel a job (a running one is rolled back)"
)
def cancel_job(
    job_id: int, principal: Operator, request: Request, session: SessionDep, platform: PlatformDep
) -> dict[str, Any]:
    with refusals():
        job = jobs.get_job(session, job_id, lock=True)
        jobs.cancel(session, job, principal.name)
    if not jobs.JobState(job.state).active:
        jobs.ended(session, job, platform)
    audit.commit_audited(request, session, target=f"job:{job.id}", detail=f"now {job.state}")
    work.notifier(request).notify(job.node)
    return job_out(job)


# --- rollouts -----------------------------------------------------------------------------------------------


@router.post(
    "/groups/{group}/switch",
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
    with refusals():
        nodes = rollouts.members(session, group)
        switch_request = jobs.to_request(jobs.SwitchOptions.from_body(body), platform)
        plans = rollouts.plan_all(session, nodes, switch_request, platform)
        if dry_run:
            dry = RolloutDryRunOut(group=group, plans={n: jobs.plan_json(p) for n, p in plans.items()})
            return _dry(request, session, dry)
        rollout = rollouts.create(
            session,
            group,
            nodes,
            switch_request,
            platform,
            concurrency=body.concurrency,
            max_failures=body.max_failures,
            created_by=principal.name,
        )
    result = rollouts.out(session, rollout)
    audit.commit_audited(
        request, session, target=f"group:{group}", status_code=201, detail=f"rollout {rollout.id}"
    )
    for name in rollout.nodes:
        work.notifier(request).notify(name)
    return result


@router.get("/rollouts", response_model=list[RolloutOut])
def list_rollouts(
    _: Viewer, session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> list[dict[str, Any]]:
    found = session.scalars(select(Rollout).order_by(Rollout.id.desc()).limit(limit))
    return [rollouts.out(session, r) for r in found]


@router.get("/rollouts/{rollout_id}", response_model=RolloutOut)
def get_rollout(rollout_id: int, _: Viewer, session: SessionDep) -> dict[str, Any]:
    with refusals():
        return rollouts.out(session, rollouts.get(session, rollout_id))


@router.post(
    "/rollouts/{rollout_id}/cancel",
    response_model=RolloutOut,
    summary="Start no more jobs and cancel the queued ones; running jobs finish",
)
def cancel_rollout(
    rollout_id: int, principal: Operator, request: Request, session: SessionDep
) -> dict[str, Any]:
    with refusals():
        rollout = rollouts.get(session, rollout_id, lock=True)
        cancelled = rollouts.cancel(session, rollout, principal.name)
    result = rollouts.out(session, rollout)
    detail = f"cancelled; queued jobs cancelled: {', '.join(str(j.id) for j in cancelled) or 'none'}"
    audit.commit_audited(request, session, target=f"rollout:{rollout_id}", detail=detail)
    for job in cancelled:
        work.notifier(request).notify(job.node)
    return result
