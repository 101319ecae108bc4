"""Run a server job's host steps with the mode engine, report each step, and survive crashes on either side.

The engine's journal makes the host side crash-safe; this adds the job around it. Before running, the agent
writes ``var/lib/gpumode/agent/job.json`` (which job, which plan). After a crash it finds that record: an
unfinished journal of the same plan is resumed (or rolled back when the job was cancelled meanwhile); a
finished one is reported as it ended; no journal means nothing ran, and the server hands the job out again.

Step reports go out from a sender thread so the host never waits for a slow server; at each step boundary the
runner gives the sender a moment to deliver (so a cancel is seen at the next boundary while the server is
reachable) and never more. The last report — every step's final state and the host's result — is sent after
a fresh snapshot, and retried until the server takes it.

The job is not over when the host's part is: the server's cloud steps may wait for the cloud platform, and if
they fail for good the host must go back. So the record stays until the server says the job ended; meanwhile
the agent asks again every ``retry_after_s`` the server names (each ask is one more try of the cloud steps),
and when the server asks for the host back (``cancel_requested`` after a ``done`` run) it undoes the
finished run from its journal (:func:`gpumode.modes.engine.undo_finished`) and reports those steps.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumode.agent.client import ApiError, Client, Stopped
from gpumode.agent.report import SnapshotReporter
from gpumode.domain import Plan
from gpumode.host.root import Host
from gpumode.modes import engine
from gpumode.modes.journal import (
    STATE_DIR,
    EngineBusy,
    Journal,
    JournalError,
    JournalStore,
    RunState,
    StepEntry,
    StepState,
    atomic_write,
    plan_from_dict,
)
from gpumode.modes.policy import RequestError
from gpumode.modes.run import ProgressEvent, RunResult

log = logging.getLogger(__name__)

RECORD_PATH = f"{STATE_DIR}/agent/job.json"
BOUNDARY_WAIT_S = 0.5  # at most this long per step for the server to hear of it (and answer a cancel)
ASK_AGAIN_S = 1.0  # while the cloud steps wait, when the server names no interval
ACTIVE = frozenset({"queued", "running"})


class JobCancelled(Exception):
    """The server asked to cancel: stop at this step boundary and roll back."""


class AgentStopping(Exception):
    """The agent was told to stop: leave at this step boundary; the journal resumes at the next start."""


def server_state(state: StepState, error: str | None = None) -> str:
    """A journal step state in the API's words."""
    if state in (StepState.STARTED, StepState.UNDOING):
        return "failed" if state is StepState.UNDOING and error else "running"
    return {
        StepState.PENDING: "pending",
        StepState.DONE: "done",
        StepState.SKIPPED: "skipped",
        StepState.FAILED: "failed",
        StepState.UNDONE: "undone",
    }[state]


def host_result(run: RunResult) -> str:
    if run.state is RunState.DONE:
        return "done"
    if run.state is RunState.ROLLED_BACK:
        return "rolled_back"
    return "failed"


def final_steps(entries: list[StepEntry]) -> list[dict[str, Any]]:
    """Every host step's last state, so the server ends up right even if some step reports were lost."""
    return [
        {
            "step": e.id,
            "state": server_state(e.state, e.error),
            "at": e.finished_at or e.started_at,
            "error": e.error,
            "note": e.note,
        }
        for e in entries
        if e.where == "host"
    ]


# --- the local record of the job in hand --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobRecord:
    job: int
    plan: dict[str, Any]
    started_at: float

    @staticmethod
    def path(host: Host) -> Path:
        return host.path(RECORD_PATH)

    def save(self, host: Host) -> None:
        body = {"job": self.job, "plan": self.plan, "started_at": self.started_at}
        atomic_write(self.path(host), json.dumps(body) + "\n")

    @classmethod
    def load(cls, host: Host) -> JobRecord | None:
        path = cls.path(host)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(int(data["job"]), dict(data["plan"]), float(data["started_at"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("ignoring an unreadable job record %s: %s", path, exc)
            return None

    @classmethod
    def clear(cls, host: Host) -> None:
        cls.path(host).unlink(missing_ok=True)


def same_plan(a: Plan, b: Plan) -> bool:
    return a.snapshot_fingerprint == b.snapshot_fingerprint and [s.id for s in a.steps] == [
        s.id for s in b.steps
    ]


# --- step reports -------------------------------------------------------------------------------------------


class EventSender:
    """Delivers one job's step reports in order from a thread; remembers whether a cancel was asked."""

    def __init__(self, client: Client, job_id: int, *, cancel_requested: bool = False) -> None:
        self.client = client
        self.job_id = job_id
        self.cancel_requested = cancel_requested
        self.gone = False  # the server says the job is over: nothing more to send
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._loop, name=f"gpumode-job-{job_id}", daemon=True)
        self._thread.start()

    def step(self, event: dict[str, Any]) -> None:
        self._idle.clear()
        self._queue.put(event)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued report was answered (or ``timeout``)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < 200:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._send(batch)
                    return
                batch.append(more)
            self._send(batch)
            if self._queue.empty():
                self._idle.set()

    def _send(self, batch: list[dict[str, Any]]) -> None:
        if self.gone:
            return
        try:
            answer = self.client.job_events(self.job_id, {"steps": batch})
            self.cancel_requested = bool(answer.get("cancel_requested"))
        except ApiError as exc:
            if exc.status in (404, 409):
                self.gone = True
            log.error("job %s: the server refused a step report: %s", self.job_id, exc)
        except Stopped:
            self.gone = True


# --- running jobs -------------------------------------------------------------------------------------------


class JobRunner:
    """Runs the jobs the server hands this host, one at a time."""

    def __init__(
        self,
        host: Host,
        client: Client,
        reporter: SnapshotReporter,
        stop: threading.Event,
        *,
        config: engine.EngineConfig | None = None,
    ) -> None:
        self.host = host
        self.client = client
        self.reporter = reporter
        self.stop = stop
        self.config = config

    def run(self, work: dict[str, Any]) -> None:
        """Run a job from the work API (a re-delivered one resumes what the record says)."""
        job_id = int(work["id"])
        record = JobRecord.load(self.host)
        if record is not None and record.job == job_id:
            self.recover()
            return
        plan = plan_from_dict(work["plan"])
        if work.get("cancel_requested") and self._ran_elsewhere(job_id):
            return
        JobRecord(job_id, work["plan"], time.time()).save(self.host)
        log.info("job %s: switching to %s (%d step(s))", job_id, plan.request.mode.value, len(plan.steps))
        self._execute(job_id, plan, mode="apply", cancel=bool(work.get("cancel_requested")))

    def recover(self) -> None:
        """At start (or when the server re-delivers the job in hand): settle the job the record names."""
        record = JobRecord.load(self.host)
        if record is None:
            return
        plan = plan_from_dict(record.plan)
        store = JournalStore(self.host)
        unfinished = store.unfinished()
        try:
            server_view = self.client.job(record.job)
        except ApiError as exc:
            log.warning(
                "job %s: the server does not know it any more (%s); settling the host only", record.job, exc
            )
            server_view = {"state": "gone", "cancel_requested": False}
        if unfinished is not None and same_plan(unfinished.plan, plan):
            cancel = bool(server_view.get("cancel_requested"))
            log.info(
                "job %s: %s the run a restart interrupted",
                record.job,
                "rolling back" if cancel else "resuming",
            )
            self._execute(record.job, plan, mode="rollback" if cancel else "resume", cancel=cancel)
            return
        finished = _finished_run(store, plan, record.started_at)
        wants_undo = bool(server_view.get("cancel_requested")) and server_view.get("state") in ACTIVE
        if finished is not None and finished.state is RunState.DONE and wants_undo:
            log.info("job %s: the server wants the finished run undone (its cloud side failed)", record.job)
            self._undo(record.job, plan, finished.plan_id)
            return
        if finished is not None:
            log.info(
                "job %s: it ended (%s) before the restart; reporting it", record.job, finished.state.value
            )
            run = RunResult(finished.plan_id, finished.state, finished.path, finished.steps, finished.error)
            self._finish(record.job, host_result(run), run.error, final_steps(run.steps))
            return
        # nothing ran: the server still has the job running and hands it out again
        log.info("job %s: nothing ran before the restart; taking it again from the server", record.job)
        JobRecord.clear(self.host)

    # --- one run --------------------------------------------------------------------------------------------

    def _ran_elsewhere(self, job_id: int) -> bool:
        """A cancelled job without a local record whose host steps the server saw run (the record was lost):
        which run to undo is unknown here, so say so rather than report it rolled back."""
        seen = self.client.job(job_id)
        if not any(s.get("where") == "host" and s.get("state") != "pending" for s in seen.get("steps", [])):
            return False
        log.error("job %s: asked to undo it, but this host has no record of running it", job_id)
        self._finish(
            job_id,
            "failed",
            "the host ran this job's steps but its agent lost the record of it; "
            "check the host and switch it back by hand",
            [],
        )
        return True

    def _undo(self, job_id: int, plan: Plan, plan_id: str) -> None:
        """Undo the job's finished run (the server asked: its cloud steps failed for good)."""
        self._execute(job_id, plan, mode="rollback", cancel=True, undo=plan_id)

    def _undo_recorded(self, job_id: int) -> None:
        """Undo the run the job record names; without one, or without its journal, nothing can be undone:
        the host's result is reported as it is."""
        record = JobRecord.load(self.host)
        plan = plan_from_dict(record.plan) if record is not None else None
        finished = _finished_run(JournalStore(self.host), plan, 0.0) if plan is not None else None
        if plan is None or finished is None:
            log.error("job %s: the server wants the host back, but its run is not on this host", job_id)
            self._finish(job_id, "failed", "the finished run to undo is not on this host", [])
            return
        log.info("job %s: the cloud side failed for good; undoing the host's run", job_id)
        self._undo(job_id, plan, finished.plan_id)

    def _execute(self, job_id: int, plan: Plan, *, mode: str, cancel: bool, undo: str = "") -> None:
        """Run ``plan`` as ``mode`` says (apply, resume, rollback), or with ``undo`` (a finished run's plan
        id) undo that run, and report the result."""
        sender = EventSender(self.client, job_id, cancel_requested=cancel)
        progress = self._progress(sender)
        self.reporter.paused.set()
        try:
            try:
                run = (
                    engine.undo_finished(self.host, undo, progress)
                    if undo
                    else self._run(plan, mode, progress, cancel)
                )
            except JobCancelled:
                log.info("job %s: cancelled; rolling back", job_id)
                run = engine.rollback(self.host, progress)
            if run is None:  # cancelled before anything ran, or nothing was left to resume
                result, error, steps = (
                    ("rolled_back", None, []) if cancel else ("failed", "nothing to resume", [])
                )
            else:
                result, error, steps = host_result(run), run.error, final_steps(run.steps)
        except AgentStopping:
            log.info("job %s: stopping between steps; the journal resumes at the next start", job_id)
            sender.wait_idle(2.0)
            sender.close()
            return
        except (engine.EngineError, EngineBusy, JournalError, RequestError) as exc:
            log.error("job %s: cannot run: %s", job_id, exc)
            result, error, steps = "failed", str(exc), []
        finally:
            self.reporter.paused.clear()
        sender.wait_idle(5.0)
        sender.close()
        self._finish(job_id, result, error, steps)

    def _run(self, plan: Plan, mode: str, progress: Any, cancel: bool) -> RunResult | None:
        if mode == "resume":
            return engine.resume(self.host, progress)
        if mode == "rollback":
            return engine.rollback(self.host, progress)
        if cancel:
            return None  # cancelled before anything ran here
        self._settle_foreign()
        return engine.apply(self.host, plan, progress, config=self.config).run

    def _settle_foreign(self) -> None:
        """An unfinished run that is not this job's (a local ``gpumode apply`` that crashed) is finished
        first, without reporting its steps as this job's."""
        if JournalStore(self.host).unfinished() is not None:
            log.warning("finishing an unfinished run left on the host before taking the job")
            engine.resume(self.host)

    def _progress(self, sender: EventSender) -> Any:
        def progress(event: ProgressEvent) -> None:
            if event.step.where == "host":
                sender.step(
                    {
                        "step": event.step.id,
                        "state": server_state(event.state, event.error),
                        "at": time.time(),
                        "error": event.error,
                        "note": event.note,
                    }
                )
            if event.phase == "apply" and event.state in (StepState.DONE, StepState.SKIPPED):
                if event.step.where == "host":
                    sender.wait_idle(BOUNDARY_WAIT_S)
                if self.stop.is_set():
                    raise AgentStopping
                if sender.cancel_requested:
                    raise JobCancelled

        return progress

    def _finish(self, job_id: int, result: str, error: str | None, steps: list[dict[str, Any]]) -> None:
        """Fresh snapshot first (the server's cloud steps read it), then the host's result; then follow the
        job until the server ends it (see the module doc), and forget it."""
        self.reporter.report(force=True)
        body: dict[str, Any] = {"steps": steps, "host": {"result": result, "error": error}}
        try:
            answer = self.client.job_events(job_id, body)
            log.info("job %s: host %s; the job is %s", job_id, result, answer.get("state"))
            while answer.get("state") in ACTIVE:
                if answer.get("cancel_requested") and result == "done":
                    self._undo_recorded(job_id)
                    return
                wait = answer.get("retry_after_s")
                if self.stop.wait(float(wait) if wait is not None else ASK_AGAIN_S):
                    log.info("job %s: stopping while its cloud steps wait; the next start asks again", job_id)
                    return
                answer = self.client.job_events(job_id, {"steps": []})
        except ApiError as exc:  # closed already (409), gone (404), or refused: nothing a retry would change
            log.error("job %s: the server did not take the result: %s", job_id, exc)
        except Stopped:
            return  # the record stays: the next start reports again
        JobRecord.clear(self.host)


def _finished_run(store: JournalStore, plan: Plan, since: float) -> Journal | None:
    for journal in reversed(store.history(limit=5)):
        if journal.created_at >= since - 1.0 and same_plan(journal.plan, plan):
            return journal
    return None
