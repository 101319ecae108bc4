"""The switch service: the one way into a switch, a rollout or a cancel, for the REST API and the dashboard.

Each entry point plans, stores, writes the call's audit entry in the same commit as the change, and only
then wakes the agents concerned, so no caller can forget a step or wake an agent for work that was never
stored. A dry run (:func:`preview_switch`, :func:`preview_rollout`) stores nothing and, when it plans,
leaves no audit entry (a refused one is on record like any refusal). Refusals are raised
(:class:`JobError`, :class:`NotFound`, :class:`ActiveJobExists`, :class:`JobConflict`) with nothing
stored; each caller renders them its own way.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from gpumode.cloud.base import CloudPlatform
from gpumode.domain import Plan
from gpumode.server import whitelist
from gpumode.server.audit import Trail
from gpumode.server.models import Job, Rollout
from gpumode.server.schemas import RolloutIn, SwitchIn
from gpumode.server.switch import rollouts
from gpumode.server.switch.ending import ended
from gpumode.server.switch.errors import ActiveJobExists
from gpumode.server.switch.lifecycle import cancel
from gpumode.server.switch.planning import find_node, plan_for_node, to_request
from gpumode.server.switch.states import JobState
from gpumode.server.switch.store import create_job, get_job
from gpumode.server.wakeups import Wakeups


@dataclass(frozen=True, slots=True)
class Caller:
    """One call into the service: its session (the service commits it), the cloud platform that plans with
    it, where its audit entry goes, the wake-ups of this server, and who asks (``created_by``, ``by``)."""

    session: Session
    platform: CloudPlatform
    trail: Trail
    wakeups: Wakeups
    name: str


def preview_switch(caller: Caller, node: str, body: SwitchIn) -> Plan:
    """The plan a switch would run, with the platform's host steps; stores nothing."""
    session = caller.session
    try:
        found = find_node(session, node)
        plan = plan_for_node(
            session, found, to_request(body, caller.platform), whitelist.rules(session), caller.platform
        )
    finally:
        session.rollback()
    caller.trail.skip()
    return plan


def start_switch(caller: Caller, node: str, body: SwitchIn) -> Job:
    """Plan ``body`` on the node, store it as a queued job, audit it, wake the node's agent."""
    session = caller.session
    found = find_node(session, node)
    plan = plan_for_node(
        session, found, to_request(body, caller.platform), whitelist.rules(session), caller.platform
    )
    try:
        job = create_job(session, found, plan, created_by=caller.name)
    except ActiveJobExists:
        session.rollback()
        raise
    detail = f"job {job.id}: {job.request}"
    caller.trail.commit(session, target=f"node:{node}", status_code=201, detail=detail)
    caller.wakeups.notify(node)
    return job


def preview_rollout(caller: Caller, group: str, body: RolloutIn) -> dict[str, Plan]:
    """Every member's plan, as :func:`start_rollout` would make them; stores nothing."""
    session = caller.session
    try:
        nodes = rollouts.members(session, group)
        plans = rollouts.plan_all(session, nodes, to_request(body, caller.platform), caller.platform)
    finally:
        session.rollback()
    caller.trail.skip()
    return plans


def start_rollout(caller: Caller, group: str, body: RolloutIn) -> Rollout:
    """Plan every member (one that may not be switched refuses the whole rollout), store the rollout, start
    its first jobs, audit it, wake their agents."""
    session = caller.session
    try:
        nodes = rollouts.members(session, group)
        request = to_request(body, caller.platform)
        rollouts.plan_all(session, nodes, request, caller.platform)
        rollout = rollouts.create(
            session,
            group,
            nodes,
            request,
            caller.platform,
            concurrency=body.concurrency,
            max_failures=body.max_failures,
            created_by=caller.name,
        )
    except Exception:
        session.rollback()
        raise
    caller.trail.commit(session, target=f"group:{group}", status_code=201, detail=f"rollout {rollout.id}")
    for name in rollout.nodes:
        caller.wakeups.notify(name)
    return rollout


def cancel_job(caller: Caller, job_id: int) -> Job:
    """Cancel a queued job at once, or ask the agent to roll a running one back; audit it, wake the agent."""
    session = caller.session
    job = get_job(session, job_id, lock=True)
    cancel(session, job, caller.name)
    if not JobState(job.state).active:
        ended(session, job, caller.platform)
    caller.trail.commit(session, target=f"job:{job.id}", detail=f"now {job.state}")
    caller.wakeups.notify(job.node)
    return job


def cancel_rollout(caller: Caller, rollout_id: int) -> Rollout:
    """Start no more of the rollout's jobs and cancel its queued ones; audit it, wake their agents."""
    session = caller.session
    rollout = rollouts.get(session, rollout_id, lock=True)
    cancelled = rollouts.cancel(session, rollout, caller.name)
    detail = f"cancelled; queued jobs cancelled: {', '.join(str(j.id) for j in cancelled) or 'none'}"
    caller.trail.commit(session, target=f"rollout:{rollout_id}", detail=detail)
    for job in cancelled:
        caller.wakeups.notify(job.node)
    return rollout
