"""Switch requests, jobs and rollouts (operators act, viewers read). The agent's side is in
:mod:`gpumode.server.routes.work`."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.responses import JSONResponse
from sqlalchemy import select

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
        "cancel_requested": job.cancel_requested,
        "error": job.error,
        "created_by": job.created_by,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "updated_at": job.updated_at,
    }


def _options(body: SwitchIn) -> jobs.SwitchOptions:
    return jobs.SwitchOptions(
        mode=body.mode,
        gpus=tuple(body.gpus),
        vgpu_type=body.vgpu_type,
        vgpu_count=body.vgpu_count,
        profile=body.profile,
        passthrough_alias=body.passthrough_alias,
        vm_policy=body.vm_policy,
    )


def _refused(exc: jobs.JobError) -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, exc.detail())


def _not_found(exc: jobs.NotFound) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, str(exc))


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
    try:
        node = jobs.find_node(session, name)
        switch_request = jobs.to_request(_options(body), platform)
        plan = jobs.plan_for_node(session, node, switch_request, whitelist.load(session), platform)
    except jobs.NotFound as exc:
        raise _not_found(exc) from exc
    except jobs.JobError as exc:
        raise _refused(exc) from exc
    if dry_run:
        session.rollback()
        audit.skip(request)  # a dry run changes nothing, so it leaves no trace either
        return _dry(DryRunOut(node=name, plan=jobs.plan_json(plan)))
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


def _dry(body: Any) -> JSONResponse:
    """A dry run answers 200, not the 201 of a created job."""
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
    try:
        job = jobs.get_job(session, job_id)
    except jobs.NotFound as exc:
        raise _not_found(exc) from exc
    node_access(principal, job.node, users_need=Role.VIEWER)
    return job_out(job)


@router.post(
    "/jobs/{job_id}/cancel", response_model=JobOut, summary="Cancel a job (a running one is rolled back)"
)
def cancel_job(job_id: int, principal: Operator, request: Request, session: SessionDep) -> dict[str, Any]:
    try:
        job = jobs.get_job(session, job_id, lock=True)
        jobs.cancel(session, job, principal.name)
    except jobs.NotFound as exc:
        raise _not_found(exc) from exc
    except jobs.JobConflict as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    if not jobs.JobState(job.state).active:
        session.add(jobs.ended_event(job))
        rollouts.after_job(session, job)
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
    try:
        nodes = rollouts.members(session, group)
        switch_request = jobs.to_request(_options(body), platform)
        plans = rollouts.plan_all(session, nodes, switch_request)
        if dry_run:
            session.rollback()
            audit.skip(request)
            return _dry(RolloutDryRunOut(group=group, plans={n: jobs.plan_json(p) for n, p in plans.items()}))
        rollout = rollouts.create(
            session,
            group,
            nodes,
            switch_request,
            concurrency=body.concurrency,
            max_failures=body.max_failures,
            created_by=principal.name,
        )
    except jobs.NotFound as exc:
        raise _not_found(exc) from exc
    except jobs.JobError as exc:
        raise _refused(exc) from exc
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
    try:
        return rollouts.out(session, rollouts.get(session, rollout_id))
    except jobs.NotFound as exc:
        raise _not_found(exc) from exc


@router.post("/rollouts/{rollout_id}/cancel", response_model=RolloutOut, summary="Start no more jobs")
def cancel_rollout(rollout_id: int, _: Operator, request: Request, session: SessionDep) -> dict[str, Any]:
    try:
        rollout = rollouts.get(session, rollout_id)
        rollouts.cancel(session, rollout)
    except jobs.NotFound as exc:
        raise _not_found(exc) from exc
    except jobs.JobConflict as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    result = rollouts.out(session, rollout)
    audit.commit_audited(request, session, target=f"rollout:{rollout_id}", detail="cancelled")
    return result
