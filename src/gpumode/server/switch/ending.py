"""What follows a job's end, wherever it ended: its event, and its rollout's next move."""

from __future__ import annotations

from sqlalchemy.orm import Session

from gpumode.cloud.base import CloudPlatform
from gpumode.server.models import Job
from gpumode.server.switch import rollouts
from gpumode.server.switch.store import ended_event


def ended(session: Session, job: Job, platform: CloudPlatform, note: str | None = None) -> None:
    """What follows a job's end, wherever it ended (an API call, the dashboard, the platform refusing): its
    event, and its rollout's next move (planned with ``platform``, so the next job has the platform's host
    steps too). The caller commits."""
    session.add(ended_event(job, note))
    rollouts.after_job(session, job, platform)
