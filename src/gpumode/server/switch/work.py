"""The agent's side of a job: it takes the job (a queued one starts once the cloud platform holds the node),
reports its host steps' end, and asks again while the server still has cloud work to do."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpumode.cloud.base import CloudPlatform
from gpumode.server.models import Job
from gpumode.server.switch.cloud_steps import restore_cloud, run_cloud_steps
from gpumode.server.switch.errors import JobError
from gpumode.server.switch.hold import end, take_hold
from gpumode.server.switch.lifecycle import CANCEL_REQUESTED, undo_host
from gpumode.server.switch.planning import switch_hooks
from gpumode.server.switch.states import HostState, JobState
from gpumode.server.switch.store import now


def claim_work(session: Session, node: str, platform: CloudPlatform) -> Job | None:
    """The node's job whose host steps are not finished; a queued one becomes running. Commits.

    With a platform that has switch hooks, a queued job starts only once the platform is usable and has
    taken the node out of scheduling (:func:`take_hold`); until then the caller gets None, and the job
    says why it waits.
    """
    job = session.scalars(
        select(Job)
        .where(
            Job.node == node,
            Job.state.in_([JobState.QUEUED.value, JobState.RUNNING.value]),
            Job.host_state.in_([HostState.PENDING.value, HostState.RUNNING.value]),
        )
        .order_by(Job.id)
        .with_for_update()
    ).first()
    if job is None:
        session.rollback()
        return None
    if job.state == JobState.QUEUED.value:
        hooks = switch_hooks(platform)
        if hooks is not None and not take_hold(session, platform, hooks, job):
            return None
        job.state = JobState.RUNNING.value
        job.host_state = HostState.RUNNING.value
        job.started_at = job.updated_at = now()
        session.commit()
    return job


def host_finished(
    session: Session, platform: CloudPlatform, job: Job, result: HostState, error: str | None
) -> None:
    """The agent's last word on the host steps; on success the cloud steps run now (the caller commits)."""
    if result in (HostState.PENDING, HostState.RUNNING):
        raise JobError("bad_result", f"a host result must be done, rolled_back or failed, not {result.value}")
    job.host_state = result.value
    job.updated_at = now()
    undo = (job.cloud or {}).get("undo")
    if result is HostState.DONE and undo is not None:
        # the platform failed at a checkpoint, but the agent ended its run before it heard: undo the run
        undo_host(job, str(undo["reason"]))
        return
    if result is HostState.DONE and job.cancel_requested:
        # cancelled while the agent finished the host steps: their finished run is undone, as promised
        asked = (job.error or CANCEL_REQUESTED).split(":")[0]
        undo_host(job, f"{asked}; the host steps had finished before the agent heard, so their run is undone")
        return
    if result is HostState.DONE:
        run_cloud_steps(session, platform, job)
        return
    if undo is not None and result is HostState.ROLLED_BACK:
        restore_cloud(session, platform, job)
        return
    if undo is not None:
        end(platform, job, JobState.FAILED, f"{undo['reason']}; putting the host back failed: {error}")
        return
    why: str | None = error
    if job.cancel_requested and job.error:
        if result is HostState.ROLLED_BACK:
            why = f"{job.error}; the host was rolled back"
        else:
            why = f"{job.error}; rolling the host back failed: {error}"
    end(platform, job, JobState.ROLLED_BACK if result is HostState.ROLLED_BACK else JobState.FAILED, why)


def continue_cloud(session: Session, platform: CloudPlatform, job: Job) -> None:
    """The agent asks again about a job whose host part is over: one more try at what the server still does
    (the cloud steps, or putting the cloud's picture back after the host was undone)."""
    if job.host_state == HostState.DONE.value:
        run_cloud_steps(session, platform, job)
    elif job.host_state == HostState.ROLLED_BACK.value and "undo" in (job.cloud or {}):
        restore_cloud(session, platform, job)
