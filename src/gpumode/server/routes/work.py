"""The agent's side of switch jobs: long-poll for work, report each step, then the host's result.

Only the node's own agent (its node token) may take its work or report on its jobs: a person's token, even an
admin's, is refused, so a job's progress is always what the host itself said.

The long poll holds no database connection while it waits (thousands of agents wait at once): it checks for
work in a short session, then sleeps on a per-node wake-up that a new job or a cancel in this process sets;
every ``POLL_S`` it checks again anyway, which is how a job created by another server process is found.
The wake-ups live in the server's state (:class:`~gpumode.server.wakeups.Wakeups`), set by the switch service.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from gpumode import wire
from gpumode.server import audit
from gpumode.server.auth import Principal, Role, authenticate, bearer_secret
from gpumode.server.deps import PlatformDep, PrincipalDep, SessionDep
from gpumode.server.models import Node
from gpumode.server.responses import errors
from gpumode.server.schemas import JobEventsAck, JobEventsIn, RowId, WorkJob, WorkOut
from gpumode.server.state import ServerState
from gpumode.server.switch.ending import ended
from gpumode.server.switch.errors import JobError, NotFound, refusal_detail
from gpumode.server.switch.lifecycle import StepReport, apply_step_reports, retry_after
from gpumode.server.switch.states import HostState, JobState, StepState
from gpumode.server.switch.store import get_job
from gpumode.server.switch.work import claim_work, continue_cloud, host_finished

router = APIRouter(tags=["agents"])

POLL_S = 1.0  # how often a waiting long poll looks at the database for work another process created


def _node_only(principal: Principal, node: str) -> None:
    if principal.role is not Role.NODE:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "only the node's agent (its node token) may do this")
    if principal.node != node:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"this node token belongs to {principal.node}, not {node}"
        )


def _authenticate(state: ServerState, request: Request, node: str) -> None:
    with state.sessions() as session:
        secret = bearer_secret(request.headers.get("authorization"))
        principal = authenticate(session, secret) if secret else None
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or invalid bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    _node_only(principal, node)


def _note_agent(state: ServerState, node: str, hello: wire.AgentHello) -> None:
    """Keep what the agent said about itself on its node (the node list shows agents out of date); a write
    only when it changed."""
    with state.sessions() as session:
        row = session.scalars(select(Node).where(Node.name == node)).first()
        protocol = str(hello.protocol)
        if row is not None and (row.agent_version, row.agent_protocol) != (hello.version, protocol):
            row.agent_version, row.agent_protocol = hello.version, protocol
            session.commit()


def _claim(state: ServerState, node: str, hello: wire.AgentHello) -> WorkOut | None:
    with state.sessions() as session:
        platform = state.platform_factory(session)
        job = claim_work(session, node, platform)
        if job is None:
            return None
        missing = wire.missing_actions(job.plan, hello)
        untouched = all(s.get("state") == StepState.PENDING.value for s in job.steps)
        if missing and untouched:
            # never sent: the agent would not know these steps; the job fails before anything ran
            error = (
                f"the agent on {node} (gpumode {hello.version or '0.1.0'}, protocol {hello.protocol}) cannot "
                f"run {', '.join(missing)}: upgrade gpumode on {node}, then switch again"
            )
            host_finished(session, platform, job, HostState.FAILED, error)
            ended(session, job, platform)
            session.commit()
            return None
        plan = wire.plan_for(job.plan, hello.protocol)
        return WorkOut(
            job=WorkJob(id=job.id, state=job.state, cancel_requested=job.cancel_requested, plan=plan)
        )


@router.get(
    "/nodes/{name}/work",
    response_model=WorkOut,
    responses={**errors(404, 426), 204: {"description": "no work arrived within `wait` seconds"}},
    summary="Long poll for the node's next job (its agent's node token only)",
)
async def work(
    name: str, request: Request, wait: Annotated[float, Query(ge=0, le=60)] = 25.0
) -> WorkOut | Response:
    state: ServerState = request.app.state.gpumode
    try:
        hello = wire.agent_hello(request.headers)
    except wire.WireError as exc:
        raise HTTPException(status.HTTP_426_UPGRADE_REQUIRED, str(exc)) from exc
    await run_in_threadpool(_authenticate, state, request, name)
    await run_in_threadpool(_note_agent, state, name, hello)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    with state.wakeups.waiter(name) as wake:  # registered before the first look: no wake-up is lost
        while True:
            wake.clear()
            found = await run_in_threadpool(_claim, state, name, hello)
            if found is not None:
                return found
            remaining = deadline - loop.time()
            if remaining <= 0:
                return Response(status_code=status.HTTP_204_NO_CONTENT)
            with suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=min(POLL_S, remaining))


@router.post(
    "/jobs/{job_id}/events",
    responses=errors(404, 409),
    response_model=JobEventsAck,
    response_model_exclude_none=True,
    summary="The agent reports its steps, and at the end the host's result (its node token only)",
)
def events(
    job_id: RowId,
    body: JobEventsIn,
    principal: PrincipalDep,
    request: Request,
    session: SessionDep,
    platform: PlatformDep,
) -> JobEventsAck:
    try:
        job = get_job(session, job_id, lock=True)
    except NotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
    _node_only(principal, job.node)
    if not JobState(job.state).active:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} is already {job.state}")
    reports = [
        StepReport(
            step=e.step,
            state=StepState(e.state),
            at=None if e.at is None else datetime.fromtimestamp(e.at, UTC),
            error=e.error,
            note=e.note,
        )
        for e in body.steps
    ]
    try:
        if job.host_state in (HostState.PENDING.value, HostState.RUNNING.value):
            apply_step_reports(job, reports, platform)
            if body.host is not None:
                host_finished(session, platform, job, HostState(body.host.result), body.host.error)
        else:
            # the host part is over: the cloud steps wait for the platform (or a server died before they
            # ran), or the cloud's picture of an undone host is being put back: one more try
            continue_cloud(session, platform, job)
    except JobError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, refusal_detail(exc)) from exc
    detail: dict[str, Any] = {"steps": len(reports)}
    if body.host is not None:
        detail["host"] = body.host.result
    if not JobState(job.state).active:
        ended(session, job, platform)
    audit.commit_audited(request, session, target=f"job:{job.id}", detail=f"{detail} -> {job.state}")
    return JobEventsAck(
        job=job.id,
        state=job.state,
        cancel_requested=job.cancel_requested,
        retry_after_s=retry_after(job),
    )
