"""Run a plan step by step with a journal: finish it, resume it after a crash, or put the host back.

The runner's contract, per step:

1. ``check`` — already done? A fresh step that is already done is ``skipped`` (and never undone: gpumode did
   not do it). A step that was ``started`` before a crash and now checks done is ``done`` (gpumode did it).
2. mark ``started`` and save the journal, *then* ``apply``; the step saves its undo record (``ctx.remember``)
   before it acts, so the journal always knows at least as much as the host shows.
3. ``check`` again: a step whose effect is not visible afterwards failed, even if nothing raised (a kernel
   write such as ``drivers_probe`` "succeeds" without binding anything).
4. mark ``done`` (or ``failed`` with the error) and save.

On failure the runner undoes, in reverse order, every step that was done, started or failed (undo is written
to cope with partial work), unless told to stop where it is. Cloud steps (``where="cloud"``) are skipped and
recorded as such: the server runs them.

Interruption: while it runs in the main thread the runner defers SIGINT and SIGTERM. The step running then
(and the external command inside it) finishes; the runner stops at that step boundary, records where and
why in the journal (``stopped``, or still ``rolling_back``) and returns with ``interrupted`` set, so the
caller can say which command finishes or undoes the run. SIGKILL cannot be deferred: the journal written
before each step, and each step's check and undo coping with partial work, make resume and rollback work
from any instant.

Verification: given a ``verify`` callback (the engine's ``assert``), a run is ``done`` and a rollback
``rolled_back`` only if the host then shows the state it claims; otherwise the journal stays unfinished and
the error names what is left.

Fault injection for tests: ``GPUMODE_FAULT_KILL=<phase>:<n>`` SIGKILLs this process at step ``n`` (1-based, or
a step id); ``phase`` is ``before`` (journal says started, nothing applied), ``after`` (applied, journal still
says started) or ``undo`` (journal says undoing, nothing undone). Only a real kill shows whether the journal
is enough.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpumode.domain import Step
from gpumode.host.root import Host
from gpumode.host.vms import Hypervisor, open_hypervisor
from gpumode.modes.journal import Journal, JournalStore, RunState, StepEntry, StepState
from gpumode.modes.steps import StepContext, StepError, StepRegistry, default_registry

FAULT_ENV = "GPUMODE_FAULT_KILL"

Phase = Literal["apply", "undo"]


@dataclass(frozen=True, slots=True)
class ProgressEvent:
    """One change of one step's state, for a live display."""

    plan_id: str
    index: int  # 0-based position in the plan
    total: int
    step: Step
    state: StepState
    phase: Phase
    elapsed_s: float | None = None
    error: str | None = None
    note: str | None = None


ProgressCallback = Callable[[ProgressEvent], None]
# what keeps the host from the state a finished journal claims: (journal, rolled_back) -> differences
Verifier = Callable[[Journal, bool], list[str]]
DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(slots=True)
class StepTiming:
    """Where one step's time went: in the step's own work, or in the engine around it."""

    step_id: str
    action: str
    work_s: float = 0.0  # apply / undo: the host operations themselves
    check_s: float = 0.0  # the engine's checks before and after
    journal_s: float = 0.0  # journal saves (atomic write + fsync)
    journal_writes: int = 0


@dataclass(slots=True)
class RunResult:
    plan_id: str
    state: RunState
    journal_path: Path
    steps: list[StepEntry]
    error: str | None = None
    undo_errors: list[str] = field(default_factory=list)
    timings: list[StepTiming] = field(default_factory=list)
    interrupted: str | None = None  # the signal (SIGINT, SIGTERM) the run stopped for at a step boundary
    stopped_at: str | None = None  # the last step that ran before the interruption
    left: list[str] = field(default_factory=list)  # what verification found the host still lacks
    undone: list[str] = field(default_factory=list)  # ids of the steps undone here, in the order undone
    verify_s: float = 0.0  # time spent verifying the claimed state (a discovery)

    @property
    def ok(self) -> bool:
        return self.state is RunState.DONE


class Runner:
    """Executes one plan under a journal. The caller holds the host lock (see :class:`~.journal.HostLock`)."""

    def __init__(
        self,
        host: Host,
        *,
        progress: ProgressCallback | None = None,
        registry: StepRegistry | None = None,
        hypervisor: Hypervisor | None = None,
        verify: Verifier | None = None,
    ) -> None:
        self.host = host
        self._verify = verify
        self._caught: str | None = None
        self._last_step: str | None = None
        self._undone: list[str] = []  # step ids in the order this runner undid them
        self._verify_s = 0.0
        self.store = JournalStore(host)
        self.registry = registry or default_registry()
        self._progress = progress
        self._hypervisor = hypervisor
        self._timings: dict[str, StepTiming] = {}
        self._unsaved = False

    # --- entry points ---------------------------------------------------------------------------------------

    def run(self, journal: Journal, *, rollback_on_failure: bool = True) -> RunResult:
        """Run (or resume) ``journal`` forwards; a journal that was rolling back keeps rolling back."""
        with self._deferred_signals():
            return self._run(journal, rollback_on_failure)

    def rollback(self, journal: Journal) -> RunResult:
        """Undo, newest first, every step this plan did or may have half done."""
        with self._deferred_signals():
            return self._rollback(journal)

    def _run(self, journal: Journal, rollback_on_failure: bool) -> RunResult:
        if journal.state is RunState.ROLLING_BACK:
            return self._rollback(journal)
        journal.state = RunState.RUNNING
        journal.error = None
        self._save(journal, None)
        for index, entry in enumerate(journal.steps):
            if entry.state in (StepState.DONE, StepState.SKIPPED):
                continue
            if self._caught:
                return self._interrupted(journal, RunState.STOPPED)
            self._last_step = entry.id
            if not self._forward(journal, index, entry):
                journal.error = f"step {entry.id} ({entry.action} {entry.target}) failed: {entry.error}"
                if rollback_on_failure and not self._caught:
                    return self._rollback(journal)
                if self._caught:
                    return self._interrupted(journal, RunState.STOPPED)
                journal.state = RunState.STOPPED
                self._save(journal, None)
                return self._result(journal)
        left = self._verified(journal, rolled_back=False)
        if left:
            journal.state = RunState.STOPPED
            journal.error = "every step ran, but the host does not show the target state: " + "; ".join(left)
            self._save(journal, None)
            return self._result(journal, left=left)
        journal.state = RunState.DONE
        self._save(journal, None)
        self.store.archive(journal)
        return self._result(journal)

    def _rollback(self, journal: Journal) -> RunResult:
        why = journal.error
        journal.state = RunState.ROLLING_BACK
        self._save(journal, None)
        undo_errors: list[str] = []
        for index in reversed(range(len(journal.steps))):
            entry = journal.steps[index]
            if not entry.touched or entry.state in (StepState.SKIPPED, StepState.UNDONE, StepState.PENDING):
                continue
            if self._caught:
                return self._interrupted(journal, RunState.ROLLING_BACK)
            self._last_step = entry.id
            error = self._backward(journal, index, entry)
            if error:
                undo_errors.append(f"{entry.id}: {error}")
            else:
                self._undone.append(entry.id)
        if undo_errors:
            # leave the journal unfinished: the operator fixes the cause and runs --rollback again
            journal.state = RunState.STOPPED
            journal.error = (why or "rollback requested") + "; rollback incomplete: " + "; ".join(undo_errors)
            self._save(journal, None)
            result = self._result(journal)
            result.undo_errors = undo_errors
            return result
        left = self._verified(journal, rolled_back=True)
        if left:
            # every undo ran, yet the host is not as it was: say what is left; the journal stays to be settled
            journal.error = (why + "; " if why else "") + (
                "every step was undone, but the host is not back: " + "; ".join(left)
            )
            self._save(journal, None)
            return self._result(journal, left=left)
        journal.state = RunState.ROLLED_BACK
        self._save(journal, None)
        self.store.archive(journal)
        return self._result(journal)

    def _verified(self, journal: Journal, *, rolled_back: bool) -> list[str]:
        if self._verify is None:
            return []
        t = time.perf_counter()
        try:
            return self._verify(journal, rolled_back)
        finally:
            self._verify_s += time.perf_counter() - t

    def _interrupted(self, journal: Journal, state: RunState) -> RunResult:
        signame = self._caught or "a signal"
        where = f"after step {self._last_step}" if self._last_step else "before its first step"
        doing = "rolling back" if state is RunState.ROLLING_BACK else "running"
        journal.state = state
        journal.error = f"interrupted by {signame} while {doing}, {where}" + (
            f" ({journal.error})" if journal.error else ""
        )
        self._save(journal, None)
        result = self._result(journal)
        result.interrupted, result.stopped_at = signame, self._last_step
        return result

    @contextlib.contextmanager
    def _deferred_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM wait for the step boundary (main thread only: signal handlers live there)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._caught = None

        def note(signum: int, _frame: object) -> None:
            self._caught = self._caught or signal.Signals(signum).name

        previous = {sig: signal.signal(sig, note) for sig in DEFERRED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            # a caller's own handler (a daemon's stop) still hears of it; Python's default Ctrl-C does not:
            # the result says the run was interrupted and the caller says how to go on
            caught = self._caught
            if caught:
                handler = previous[signal.Signals[caught]]
                if callable(handler) and handler is not signal.default_int_handler:
                    handler(signal.Signals[caught], None)

    # --- one step -------------------------------------------------------------------------------------------

    def _forward(self, journal: Journal, index: int, entry: StepEntry) -> bool:
        step = journal.plan.steps[index]
        timing = self._timing(step)
        if step.where != "host":
            entry.state, entry.note = StepState.SKIPPED, f"{step.where} step: not run by the local engine"
            entry.started_at = entry.finished_at = time.time()
            self._later(journal)
            self._emit(journal, index, entry, "apply")
            return True
        try:
            impl = self.registry.get(step.action)
            ctx = self._context(journal, step, entry, timing)
            # started (or failed) before: gpumode may have done it, so if it checks done it stays undoable
            resumed = entry.touched and entry.state in (StepState.STARTED, StepState.FAILED)
            t = time.perf_counter()
            already = impl.check(self.host, ctx)
            timing.check_s += time.perf_counter() - t
        except Exception as exc:
            entry.state, entry.error = StepState.FAILED, _describe(exc)
            entry.started_at = entry.finished_at = time.time()
            self._save(journal, timing)
            self._emit(journal, index, entry, "apply")
            return False
        if already:
            entry.state = StepState.DONE if resumed else StepState.SKIPPED
            entry.note = "done before the restart" if resumed else "already done"
            # after a restart the time counts from the resume, not from before the crash
            entry.started_at = time.time() if resumed else (entry.started_at or time.time())
            entry.finished_at = time.time()
            self._later(journal)  # a re-check after a crash finds the same
            self._emit(journal, index, entry, "apply")
            return True
        entry.state, entry.error, entry.note, entry.touched = StepState.STARTED, None, None, True
        entry.started_at, entry.finished_at = time.time(), None
        if getattr(impl, "remembers_first", False):
            # its first ctx.remember, before it changes anything, saves this state with the undo record
            self._later(journal)
        else:
            self._save(journal, timing)
        self._emit(journal, index, entry, "apply")
        _fault_point("before", index, step)
        try:
            t = time.perf_counter()
            impl.apply(self.host, ctx)
            timing.work_s += time.perf_counter() - t
            _fault_point("after", index, step)
            t = time.perf_counter()
            done = impl.check(self.host, ctx) if getattr(impl, "verify", True) else True
            timing.check_s += time.perf_counter() - t
            if not done:
                raise StepError(f"{step.action} {step.target}: applied, but the host does not show it done")
        except Exception as exc:
            entry.state, entry.error = StepState.FAILED, _describe(exc)
            entry.finished_at = time.time()
            self._save(journal, timing)
            self._emit(journal, index, entry, "apply")
            return False
        entry.state, entry.finished_at = StepState.DONE, time.time()
        # saved with the next step's first write or the run's end: lost in a crash, the journal says started
        # and resume re-checks the step, finds it done and records it so
        self._later(journal)
        self._emit(journal, index, entry, "apply")
        return True

    def _backward(self, journal: Journal, index: int, entry: StepEntry) -> str | None:
        step = journal.plan.steps[index]
        timing = self._timing(step)
        entry.state, entry.started_at, entry.finished_at = StepState.UNDOING, time.time(), None
        self._save(journal, timing)
        self._emit(journal, index, entry, "undo")
        _fault_point("undo", index, step)
        try:
            impl = self.registry.get(step.action)
            ctx = self._context(journal, step, entry, timing)
            t = time.perf_counter()
            impl.undo(self.host, ctx, entry.record)
            timing.work_s += time.perf_counter() - t
        except Exception as exc:
            entry.error = f"undo failed: {_describe(exc)}"
            entry.finished_at = time.time()
            self._save(journal, timing)
            self._emit(journal, index, entry, "undo")
            return entry.error
        entry.state, entry.finished_at = StepState.UNDONE, time.time()
        self._save(journal, timing)
        self._emit(journal, index, entry, "undo")
        return None

    # --- plumbing -------------------------------------------------------------------------------------------

    def _context(self, journal: Journal, step: Step, entry: StepEntry, timing: StepTiming) -> StepContext:
        return StepContext(
            host=self.host,
            step=step,
            record=entry.record,
            plan=journal.plan,
            save=lambda: self._save(journal, timing),
            hypervisor_factory=self.hypervisor,
        )

    def hypervisor(self) -> Hypervisor:
        """The host's hypervisor, opened on first use (most plans never touch a VM)."""
        if self._hypervisor is None:
            self._hypervisor = open_hypervisor(self.host)
        return self._hypervisor

    def _timing(self, step: Step) -> StepTiming:
        timing = self._timings.get(step.id)
        if timing is None:
            timing = self._timings[step.id] = StepTiming(step.id, step.action)
        return timing

    def _later(self, journal: Journal) -> None:
        """A change resume would re-derive by checking the host: saved with the next durable write."""
        self._unsaved = True

    def _save(self, journal: Journal, timing: StepTiming | None) -> None:
        self._unsaved = False
        t = time.perf_counter()
        journal.save()
        if timing is not None:
            timing.journal_s += time.perf_counter() - t
            timing.journal_writes += 1

    def _emit(self, journal: Journal, index: int, entry: StepEntry, phase: Phase) -> None:
        if self._progress is None:
            return
        self._progress(
            ProgressEvent(
                plan_id=journal.plan_id,
                index=index,
                total=len(journal.steps),
                step=journal.plan.steps[index],
                state=entry.state,
                phase=phase,
                elapsed_s=entry.elapsed_s,
                error=entry.error,
                note=entry.note,
            )
        )

    def _result(self, journal: Journal, *, left: list[str] | None = None) -> RunResult:
        return RunResult(
            plan_id=journal.plan_id,
            state=journal.state,
            journal_path=journal.path,
            steps=journal.steps,
            error=journal.error,
            timings=list(self._timings.values()),
            left=list(left or []),
            undone=list(self._undone),
            verify_s=self._verify_s,
        )


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, (OSError, StepError)) or type(exc).__module__.startswith("gpumode"):
        return text
    # an unexpected exception is a bug: keep where it came from
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    return f"{type(exc).__name__}: {text}{where}"


def _fault_point(phase: str, index: int, step: Step) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    want_phase, _, where = spec.partition(":")
    if want_phase == phase and where in (str(index + 1), step.id):
        os.kill(os.getpid(), signal.SIGKILL)
