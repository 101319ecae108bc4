"""Fleet rollouts: switch every node of a host group, a few at a time, and stop when too many fail.

A rollout stores the request and its members in order; its jobs are ordinary switch jobs that point back at
it. :func:`advance` is called whenever one of its jobs ends (and when it is created, and at server start): it
starts jobs until ``concurrency`` are active, unless more than ``max_failures`` have ended other than
``succeeded``, and closes the rollout when nothing is left to start or wait for. The rollout row is locked
while it advances, so two jobs ending at once in two server processes cannot overshoot the limit.

Every plan is made with the server's cloud platform (``platform`` below), exactly as a single switch is: on
OpenStack a rollout's jobs deliver nova-compute's configuration and restart it like any other job.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpumode.cloud.base import CloudPlatform
from gpumode.domain import Plan, SwitchRequest
from gpumode.errors import GpumodeError
from gpumode.server import whitelist
from gpumode.server.models import HostGroup, Job, Node, Rollout
from gpumode.server.switch.codec import request_from_json, request_json
from gpumode.server.switch.errors import JobConflict, JobError, NotFound
from gpumode.server.switch.lifecycle import cancel as cancel_job
from gpumode.server.switch.planning import plan_for_node
from gpumode.server.switch.states import JobState
from gpumode.server.switch.store import create_job, ended_event, now


class RolloutState(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


def members(session: Session, group: str) -> list[Node]:
    """The group's nodes, by name; :class:`NotFound` for an unknown group."""
    group_id = session.scalar(select(HostGroup.id).where(HostGroup.name == group))
    if group_id is None:
        raise NotFound(f"no host group named {group!r}")
    return list(session.scalars(select(Node).where(Node.group_id == group_id).order_by(Node.name)))


class GroupNotPlannable(JobError):
    """Some members may not be switched: ``refused`` maps each, in member order, to its refusal (the
    dashboard lists them; the API shows the message, which names them all). ``choices`` are what would work
    on every refused member (e.g. the vGPU types they all offer), never member names; ``plannable`` the
    members that could be switched."""

    def __init__(self, refused: dict[str, GpumodeError], plannable: Sequence[str]) -> None:
        message = "; ".join(f"{name}: {exc.message}" for name, exc in refused.items())
        lists = [exc.choices for exc in refused.values()]
        common = [c for c in lists[0] if all(c in other for other in lists[1:])] if lists else []
        super().__init__("not_plannable", message, common)
        self.refused = {name: exc.message for name, exc in refused.items()}
        self.plannable = sorted(plannable)


def plan_all(
    session: Session, nodes: Sequence[Node], request: SwitchRequest, platform: CloudPlatform
) -> dict[str, Plan]:
    """Every member's plan, or :class:`GroupNotPlannable` naming each member that may not be switched."""
    rules = whitelist.rules(session)
    plans: dict[str, Plan] = {}
    refused: dict[str, GpumodeError] = {}
    for node in nodes:
        try:
            plans[node.name] = plan_for_node(session, node, request, rules, platform)
        except GpumodeError as exc:
            refused[node.name] = exc
    if refused:
        raise GroupNotPlannable(refused, list(plans))
    return plans


def create(
    session: Session,
    group: str,
    nodes: Sequence[Node],
    request: SwitchRequest,
    platform: CloudPlatform,
    *,
    concurrency: int,
    max_failures: int,
    created_by: str | None,
) -> Rollout:
    """Store the rollout and start its first jobs (flushes; the caller commits)."""
    if not nodes:
        raise JobError("empty_group", f"host group {group!r} has no nodes")
    rollout = Rollout(
        group_name=group,
        request=request_json(request),
        nodes=[n.name for n in nodes],
        concurrency=concurrency,
        max_failures=max_failures,
        state=RolloutState.RUNNING.value,
        blocked=[],
        created_by=created_by,
        created_at=now(),
    )
    session.add(rollout)
    session.flush()
    advance(session, rollout.id, platform)
    return rollout


def advance(session: Session, rollout_id: int, platform: CloudPlatform) -> None:
    """Start what may start, close the rollout when it is over (flushes; the caller commits)."""
    rollout = session.scalars(select(Rollout).where(Rollout.id == rollout_id).with_for_update()).first()
    if rollout is None or rollout.state != RolloutState.RUNNING.value:
        return
    own = list(session.scalars(select(Job).where(Job.rollout_id == rollout.id)))
    started = {j.node for j in own}
    blocked = list(rollout.blocked)
    active = sum(1 for j in own if JobState(j.state).active)
    rules = whitelist.rules(session)
    request = request_from_json(rollout.request)
    for name in rollout.nodes:
        if active >= rollout.concurrency or _failures(own, blocked) > rollout.max_failures:
            break
        if name in started or _is_blocked(name, blocked):
            continue
        node = session.scalars(select(Node).where(Node.name == name)).first()
        try:
            if node is None:
                raise NotFound(f"node {name} was removed")
            plan = plan_for_node(session, node, request, rules, platform)
            job = create_job(session, node, plan, created_by=f"rollout:{rollout.id}", rollout_id=rollout.id)
        except GpumodeError as exc:
            blocked.append(f"{name}: {exc.message}")
            continue
        own.append(job)
        active += 1
    rollout.blocked = blocked
    pending = [n for n in rollout.nodes if n not in {j.node for j in own} and not _is_blocked(n, blocked)]
    failures = _failures(own, blocked)
    if active == 0 and (not pending or failures > rollout.max_failures):
        rollout.state = (RolloutState.SUCCEEDED if failures == 0 else RolloutState.FAILED).value
        rollout.finished_at = now()
    session.flush()


def cancel(session: Session, rollout: Rollout, by: str) -> list[Job]:
    """Start no more jobs and cancel the queued ones (returned, so the caller can wake their agents); the
    running ones finish, since rolling a host back is a decision per host (cancel them one by one).

    The caller gets the rollout with ``lock=True`` (a job ending in another process may be advancing it)
    and commits.
    """
    if rollout.state != RolloutState.RUNNING.value:
        raise JobConflict(f"rollout {rollout.id} is already {rollout.state}")
    rollout.state = RolloutState.CANCELLED.value
    rollout.finished_at = now()
    queued = session.scalars(
        select(Job)
        .where(Job.rollout_id == rollout.id, Job.state == JobState.QUEUED.value)
        .order_by(Job.id)
        .with_for_update()
    )
    cancelled = []
    for job in queued:
        cancel_job(session, job, f"{by} (rollout {rollout.id} cancelled)")
        session.add(ended_event(job))
        cancelled.append(job)
    session.flush()
    return cancelled


def _is_blocked(name: str, blocked: Sequence[str]) -> bool:
    return any(b.startswith(f"{name}:") for b in blocked)


def _failures(own: Sequence[Job], blocked: Sequence[str]) -> int:
    ended_badly = sum(1 for j in own if not JobState(j.state).active and j.state != JobState.SUCCEEDED.value)
    return ended_badly + len(blocked)


def get(session: Session, rollout_id: int, *, lock: bool = False) -> Rollout:
    query = select(Rollout).where(Rollout.id == rollout_id)
    rollout = session.scalars(query.with_for_update() if lock else query).first()
    if rollout is None:
        raise NotFound(f"no rollout {rollout_id}")
    return rollout


def out(session: Session, rollout: Rollout) -> dict[str, Any]:
    own = {j.node: j for j in session.scalars(select(Job).where(Job.rollout_id == rollout.id))}
    nodes = []
    for name in rollout.nodes:
        job = own.get(name)
        reason = next((b.split(": ", 1)[1] for b in rollout.blocked if b.startswith(f"{name}:")), None)
        if job is not None:
            nodes.append({"node": name, "job": job.id, "state": job.state, "error": job.error})
        elif reason is not None:
            nodes.append({"node": name, "job": None, "state": "blocked", "error": reason})
        else:
            nodes.append({"node": name, "job": None, "state": "pending", "error": None})
    return {
        "id": rollout.id,
        "group": rollout.group_name,
        "state": rollout.state,
        "request": rollout.request,
        "concurrency": rollout.concurrency,
        "max_failures": rollout.max_failures,
        "failures": _failures(list(own.values()), rollout.blocked),
        "nodes": nodes,
        "created_by": rollout.created_by,
        "created_at": rollout.created_at,
        "finished_at": rollout.finished_at,
    }


def running_ids(session: Session) -> list[int]:
    return list(session.scalars(select(Rollout.id).where(Rollout.state == RolloutState.RUNNING.value)))


def after_job(session: Session, job: Job, platform: CloudPlatform) -> None:
    """A job ended: if it belongs to a rollout, let the rollout move on."""
    if job.rollout_id is not None and not JobState(job.state).active:
        advance(session, job.rollout_id, platform)
