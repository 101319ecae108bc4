"""How a job's row moves: ended, asked to undo the host's run, cancelled, and folding in the agent's step
reports. Nothing here talks to the cloud platform except the checkpoint's readiness question."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from gpumode.cloud.base import CloudPlatform, SwitchHooks
from gpumode.server.models import Job
from gpumode.server.switch.errors import JobConflict, JobError
from gpumode.server.switch.planning import switch_hooks
from gpumode.server.switch.states import HostState, JobState, StepState
from gpumode.server.switch.store import now


def finish(job: Job, state: JobState, error: str | None = None) -> None:
    job.state = state.value
    job.finished_at = job.updated_at = now()
    if error is not None:
        job.error = error


def undo_host(job: Job, reason: str) -> None:
    """Ask the agent to undo the host's finished run: the job runs again on the host (``cancel_requested``),
    and ends ``rolled_back`` once the agent reports the run undone and the cloud is put back. Nothing half
    done stays in the cloud: a failed try of the cloud steps undoes its own writes."""
    record = {k: v for k, v in (job.cloud or {}).items() if k != "retry_after_s"}
    job.cloud = {**record, "undo": {"reason": reason, "at": now().isoformat()}}
    job.host_state = HostState.RUNNING.value
    job.cancel_requested = True
    job.error = f"{reason}; rolling the host back"
    job.updated_at = now()


def cancel(session: Session, job: Job, by: str) -> None:
    """Cancel a queued job at once; ask the agent to roll a running one back (the caller commits).

    ``job.error`` then says what will really happen, and the job's end keeps saying it: a queued job is
    cancelled; a running one is rolled back from the step it is on (and if the agent had finished the host
    steps already, their finished run is undone: :func:`~gpumode.server.switch.work.host_finished`); one
    whose cloud steps wait has its host rolled back. A job whose host is already being put back refuses, with
    that reason; asking twice changes nothing.
    """
    state = JobState(job.state)
    if not state.active:
        raise JobConflict(f"job {job.id} is already {state.value}")
    if job.cancel_requested:
        undo = (job.cloud or {}).get("undo")
        if undo is not None and not str(undo.get("reason", "")).startswith((CANCELLED_BY, CANCEL_REQUESTED)):
            raise JobConflict(f"job {job.id} is already rolling the host back: {undo['reason']}")
        return  # already asked: the job says what is happening
    if state is JobState.QUEUED:
        for step in job.steps:
            step["state"] = StepState.SKIPPED.value
            step["note"] = "cancelled before it ran"
        job.steps = list(job.steps)
        finish(job, JobState.CANCELLED, f"cancelled by {by} before it started")
        return
    if job.host_state == HostState.DONE.value:  # its cloud steps are waiting for the platform
        undo_host(job, f"{CANCELLED_BY} {by} after the host steps, while the cloud steps waited")
        return
    if job.host_state != HostState.RUNNING.value:
        raise JobConflict(
            f"job {job.id} cannot be cancelled: the host was already put back; the cloud's picture of it is "
            "being restored, and the job ends rolled_back"
        )
    job.cancel_requested = True
    job.error = f"{CANCEL_REQUESTED} {by}: the agent stops after the step it is on and rolls the host back"
    job.updated_at = now()


CANCELLED_BY = "cancelled by"
CANCEL_REQUESTED = "cancel requested by"


@dataclass(frozen=True, slots=True)
class StepReport:
    step: str
    state: StepState
    at: datetime | None = None
    error: str | None = None
    note: str | None = None


def apply_step_reports(
    job: Job, reports: Sequence[StepReport], platform: CloudPlatform | None = None
) -> None:
    """Fold the agent's step reports into the job (repeating one is harmless). Unknown steps are refused.

    A step whose params say ``checkpoint: true`` (the platform's own setup on the host, e.g. restarting
    nova-compute) reported done makes the server check the platform at once: if it is not usable, the answer
    asks the agent to roll the host back, while it still can.
    """
    by_id = {s["id"]: dict(s) for s in job.steps}
    for report in reports:
        step = by_id.get(report.step)
        if step is None:
            raise JobError("unknown_step", f"job {job.id} has no step {report.step!r}", sorted(by_id))
        if step["where"] != "host":
            raise JobError("cloud_step", f"step {report.step} is a cloud step: the server runs it")
        at = (report.at or now()).isoformat()
        if report.state is StepState.RUNNING:
            step["started_at"] = step["started_at"] or at
            step["finished_at"] = None
        else:
            step["started_at"] = step["started_at"] or at
            step["finished_at"] = at
        step["state"] = report.state.value
        step["error"] = report.error
        step["note"] = report.note
        by_id[report.step] = step
    job.steps = [by_id[s["id"]] for s in job.steps]
    job.updated_at = now()
    hooks = switch_hooks(platform)
    if hooks is not None and not job.cancel_requested:
        _checkpoint(hooks, job, reports)


def _checkpoint(hooks: SwitchHooks, job: Job, reports: Sequence[StepReport]) -> None:
    params = {s["id"]: s.get("params") or {} for s in job.plan["steps"]}
    for report in reports:
        if report.state is StepState.DONE and params.get(report.step, {}).get("checkpoint"):
            why = hooks.ready()
            if why is not None:
                # nova-compute may already have reported the new inventory: once the host is back, the
                # cloud's picture of it is put back too (:func:`restore_cloud`)
                reason = f"the cloud platform failed mid-switch (after step {report.step}): {why}"
                job.cloud = {**(job.cloud or {}), "undo": {"reason": reason, "at": now().isoformat()}}
                job.cancel_requested = True
                job.error = reason
                return


def retry_after(job: Job) -> float | None:
    """When the agent should ask again: while the job waits for the cloud platform (host steps over), else
    None."""
    waiting = job.host_state in (HostState.DONE.value, HostState.ROLLED_BACK.value)
    if not JobState(job.state).active or not waiting:
        return None
    value = (job.cloud or {}).get("retry_after_s")
    return float(value) if value is not None else None
