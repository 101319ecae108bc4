"""The job row: store a planned switch as a queued job (one active job per node), read it back, and the
event that says how it ended.

One active (``queued``/``running``) job per node is enforced by a partial unique index (see
:class:`~gpumode.server.models.Job`), not by a read-then-write check, so it holds with several server
processes.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpumode.domain import Plan
from gpumode.server import sync
from gpumode.server.models import Event, Job, Node
from gpumode.server.switch.codec import plan_json, request_json
from gpumode.server.switch.errors import ActiveJobExists, NotFound
from gpumode.server.switch.states import HostState, JobState, StepState


def now() -> datetime:
    return datetime.now(UTC)


def create_job(
    session: Session,
    node: Node,
    plan: Plan,
    *,
    created_by: str | None,
    rollout_id: int | None = None,
) -> Job:
    """Store a queued job (flushes). Raises :class:`ActiveJobExists`; the session is then rolled back to
    the savepoint, so the caller's other changes survive."""
    stamp = now()
    job = Job(
        node_id=node.id,
        node=node.name,
        state=JobState.QUEUED.value,
        host_state=HostState.PENDING.value,
        request=request_json(plan.request),
        plan=plan_json(plan),
        steps=[
            {
                "id": s.id,
                "action": s.action,
                "target": s.target,
                "where": s.where,
                "description": s.description,
                "state": StepState.PENDING.value,
                "started_at": None,
                "finished_at": None,
                "error": None,
                "note": None,
            }
            for s in plan.steps
        ],
        cancel_requested=False,
        rollout_id=rollout_id,
        created_by=created_by,
        created_at=stamp,
        updated_at=stamp,
    )
    # Cheap check first for a helpful answer; the unique index is what decides under concurrency.
    existing = active_job_id(session, node.id)
    if existing is not None:
        raise ActiveJobExists(node.name, existing)
    try:
        with session.begin_nested():
            session.add(job)
            session.flush()
    except IntegrityError as exc:
        raise ActiveJobExists(node.name, None) from exc
    return job


def active_job_id(session: Session, node_id: int) -> int | None:
    return session.scalar(
        select(Job.id).where(Job.node_id == node_id, Job.state.in_([s.value for s in JobState if s.active]))
    )


def get_job(session: Session, job_id: int, *, lock: bool = False) -> Job:
    query = select(Job).where(Job.id == job_id)
    job = session.scalars(query.with_for_update() if lock else query).first()
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def ended_event(job: Job, note: str | None = None) -> Event:
    """The event that says how a job ended (``GET /events?kind=job.``)."""
    severity = sync.Severity.INFO if job.state == JobState.SUCCEEDED.value else sync.Severity.WARNING
    extra = "; ".join(x for x in (job.error, note) if x)
    return sync.make_event(
        job.node,
        f"job.{job.state}",
        severity,
        f"job:{job.id}",
        f"switch job {job.id} to {job.request.get('mode')}: {job.state}" + (f" ({extra})" if extra else ""),
        now(),
    )
