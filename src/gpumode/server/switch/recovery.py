"""At server start: finish what a dead server left of its jobs (cloud steps, holds to release)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from gpumode.cloud.base import CloudPlatform
from gpumode.server.models import Job
from gpumode.server.switch.ending import ended
from gpumode.server.switch.hold import release_hold
from gpumode.server.switch.planning import switch_hooks
from gpumode.server.switch.states import HostState, JobState
from gpumode.server.switch.store import get_job, now
from gpumode.server.switch.work import continue_cloud


def recover(session: Session, platform: CloudPlatform) -> list[int]:
    """At server start: try the cloud steps of jobs whose host part ended while no server was there (and
    the cloud's picture of hosts put back meanwhile); a try that has to wait leaves the rest to the agent's
    next ask."""
    over = [HostState.DONE.value, HostState.ROLLED_BACK.value]
    ids = list(
        session.scalars(select(Job.id).where(Job.state == JobState.RUNNING.value, Job.host_state.in_(over)))
    )
    for job_id in ids:
        job = get_job(session, job_id, lock=True)
        if job.state == JobState.RUNNING.value and job.host_state in over:
            continue_cloud(session, platform, job)
            if not JobState(job.state).active:
                ended(session, job, platform, note="cloud steps finished after a server restart")
        session.commit()
    _recover_holds(session, platform)
    return ids


RELEASE_RETRY_DAYS = 7  # how far back a restarted server looks for holds it could not release


def _recover_holds(session: Session, platform: CloudPlatform) -> None:
    """Holds a dead server left: release those of ended jobs; forget a hold being taken by a queued job (the
    next claim takes it again: ``before_switch`` recognises its own disable)."""
    hooks = switch_hooks(platform)
    if hooks is None:
        return
    recent = now() - timedelta(days=RELEASE_RETRY_DAYS)
    query = select(Job).where(
        Job.cloud.is_not(None),
        or_(Job.state.in_([s.value for s in JobState if s.active]), Job.finished_at > recent),
    )
    for job in session.scalars(query.order_by(Job.id)):
        record = job.cloud or {}
        if JobState(job.state).active:
            if job.state == JobState.QUEUED.value and "taking" in record:
                job.cloud = {}
        elif "hold" in record and not record.get("released"):
            release_hold(hooks, job, succeeded=job.state == JobState.SUCCEEDED.value)
    session.commit()
