"""The cloud platform around a job: wait until it is usable, take the node out of scheduling before the host
steps (``before_switch``'s hold), give it back once the job ended (``after_switch``).

``Job.cloud`` (JSON) records what the platform did, so any server process can finish or undo it:
  {"waiting_since": iso}             the platform was not usable when the agent asked for the job
  {"taking": iso}                    before_switch is running (another claim must not start it twice)
  {"hold": {...}, "released": bool,  before_switch's hold; released once after_switch ran,
   "problems": [...]}                with what it could not undo
and, once the host steps are done (:mod:`~gpumode.server.switch.cloud_steps`), the tries at the cloud steps:
  "cloud_since": iso, "attempts": n  when the first try ran, how many ran
  "retry_after_s": s                 the platform is away: the agent asks again after this long
  "undo": {"reason", "at"}           the cloud steps failed for good: the agent undoes the host's run
  "restore_since", "restore_attempts" after that undo: putting the cloud's picture of the host back
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from gpumode.cloud.base import CloudError, CloudPlatform, SwitchHooks
from gpumode.domain import VmPolicy
from gpumode.server.models import Job
from gpumode.server.switch.ending import ended
from gpumode.server.switch.lifecycle import finish
from gpumode.server.switch.planning import switch_hooks
from gpumode.server.switch.states import JobState
from gpumode.server.switch.store import now

log = logging.getLogger(__name__)


def take_hold(session: Session, platform: CloudPlatform, hooks: SwitchHooks, job: Job) -> bool:
    """Wait for the platform, then run ``before_switch`` and store its hold. Commits. False: not now (the
    job waits, or it ended because the platform refused or stayed away too long). ``hooks`` is
    ``platform``'s :func:`switch_hooks`; the platform itself plans the rollout's next job if this one ends."""
    record = dict(job.cloud or {})
    if "taking" in record or "hold" in record:
        session.rollback()  # another request is taking the hold right now
        return False
    why = hooks.ready()
    if why is not None:
        _wait_for_cloud(session, platform, hooks, job, record, why)
        return False
    job.cloud = {"taking": now().isoformat()}
    session.commit()  # marks the job before the (slow) platform calls, and lets go of its row
    policy_ = VmPolicy(job.request.get("vm_policy") or VmPolicy.GPU.value)
    try:
        hold = hooks.before_switch(job.node, job=f"job {job.id}", policy=policy_)
    except CloudError as exc:
        session.refresh(job, with_for_update=True)
        job.cloud = {}
        if JobState(job.state) is JobState.QUEUED:
            finish(job, JobState.FAILED, f"the cloud platform did not let the switch start: {exc}")
            ended(session, job, platform)
        session.commit()
        return False
    session.refresh(job, with_for_update=True)
    job.cloud = {"hold": hold, "released": False, "problems": []}
    if JobState(job.state) is not JobState.QUEUED:  # cancelled while the hold was being taken
        release_hold(hooks, job, succeeded=False)
        session.commit()
        return False
    job.error = None  # the waiting message, if any
    return True


def _wait_for_cloud(
    session: Session, platform: CloudPlatform, hooks: SwitchHooks, job: Job, record: dict[str, Any], why: str
) -> None:
    stamp = now()
    since = record.get("waiting_since") or stamp.isoformat()
    waited = (stamp - datetime.fromisoformat(since)).total_seconds()
    if waited >= hooks.ready_timeout_s:
        job.cloud = {}
        finish(
            job,
            JobState.FAILED,
            f"gave up after waiting {waited:.0f}s for the cloud platform; nothing was changed: {why}",
        )
        ended(session, job, platform)
    else:
        job.cloud = {"waiting_since": since}
        job.error = f"waiting for the cloud platform before starting (since {since}): {why}"
        job.updated_at = stamp
    session.commit()


def release_hold(hooks: SwitchHooks, job: Job, *, succeeded: bool) -> None:
    """``after_switch`` for the job's hold, once; what it could not undo is kept with the job and its
    error. A platform that fails here leaves the hold unreleased, for :func:`recover` to try again."""
    record = dict(job.cloud or {})
    if "hold" not in record or record.get("released"):
        return
    try:
        problems = hooks.after_switch(dict(record["hold"]), succeeded=succeeded)
    except CloudError as exc:
        log.error("job %s: could not release the cloud hold: %s", job.id, exc)
        job.cloud = {**record, "problems": [f"after_switch failed, will retry: {exc}"]}
        job.error = "; ".join(x for x in (job.error, f"the cloud hold was not released: {exc}") if x)
        return
    job.cloud = {**record, "released": True, "problems": problems}
    if problems:
        job.error = "; ".join(x for x in (job.error, *problems) if x)


def end(platform: CloudPlatform, job: Job, state: JobState, error: str | None = None) -> None:
    """End the job, then give the node back to the cloud (restarting moved instances unless it
    succeeded)."""
    finish(job, state, error)
    hooks = switch_hooks(platform)
    if hooks is not None:
        release_hold(hooks, job, succeeded=state is JobState.SUCCEEDED)
