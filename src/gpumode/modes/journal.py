"""The on-disk journal of one plan run, and the host lock that allows one runner at a time.

The journal is what makes a switch survive a crash: each step is recorded *before* it runs (``started``, with
the undo record the step computed from the state it found) and *after* (``done``, ``failed`` or ``skipped``).
A runner that restarts finds the unfinished journal and either finishes it or undoes it. Every save is atomic
(temporary file, fsync, rename, fsync of the directory), so a kill at any instant leaves either the old or the
new journal, never half of one.

Layout under the host root::

    var/lib/gpumode/engine.lock           flock'ed by the running engine (holds its pid, for the error
    message) var/lib/gpumode/journal/<id>.json     the unfinished journal (at most one, thanks to the lock)
    var/lib/gpumode/journal/done/<id>.json   finished journals (done, rolled back), kept as history

These files are gpumode's own state, not kernel files, so they are written directly rather than through
``Host.write`` (which is the path to the kernel).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from gpumode.domain import Impact, Mode, Plan, Step, SwitchRequest, VmPolicy
from gpumode.domain import StepState as StepState  # in domain now (one vocabulary); kept for run.py
from gpumode.errors import GpumodeError
from gpumode.host.root import Host

JOURNAL_SCHEMA = "gpumode.journal/v1"
STATE_DIR = "var/lib/gpumode"


class RunState(StrEnum):
    RUNNING = "running"
    DONE = "done"
    STOPPED = "stopped"  # a step failed and rollback was declined: the host is left where it stopped
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"  # as a job's state says it
    ABANDONED = "abandoned"  # given up by the operator (`gpumode journal abandon`); the host stays as left

    @property
    def finished(self) -> bool:
        return self in (RunState.DONE, RunState.ROLLED_BACK)

    @classmethod
    def _missing_(cls, value: object) -> RunState | None:
        # journals written before the vocabulary was one spelled these with a hyphen
        return {"rolling-back": cls.ROLLING_BACK, "rolled-back": cls.ROLLED_BACK}.get(str(value))


class JournalError(GpumodeError, RuntimeError):
    """A journal file is unreadable or not a gpumode journal; the message names the file."""

    default_code = "bad_journal"


class EngineBusy(GpumodeError, RuntimeError):
    """Another runner holds the host lock."""

    default_code = "engine_busy"


@dataclass(slots=True)
class StepEntry:
    """What the journal knows about one step."""

    id: str
    action: str
    target: str
    where: str
    state: StepState = StepState.PENDING
    record: dict[str, Any] = field(default_factory=dict)  # what undo needs, written before the step acts
    error: str | None = None
    note: str | None = None  # why a step was skipped, or how it was undone
    touched: bool = False  # apply was started at least once: rollback must undo it
    started_at: float | None = None
    finished_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        # by hand, not dataclasses.asdict: the journal is saved at every step and asdict deep-copies
        return {
            "id": self.id,
            "action": self.action,
            "target": self.target,
            "where": self.where,
            "state": str(self.state),
            "record": self.record,
            "error": self.error,
            "note": self.note,
            "touched": self.touched,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }

    @property
    def elapsed_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at


@dataclass(slots=True)
class Journal:
    """One plan run. ``save()`` after every change; the file is the truth after a crash."""

    path: Path
    plan_id: str
    plan: Plan
    steps: list[StepEntry]
    state: RunState = RunState.RUNNING
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)
    writes: int = 0  # saves done by this process (the bench reports the cost)
    _plan_saved: bool = field(default=False, repr=False)

    def entry(self, step_id: str) -> StepEntry:
        for entry in self.steps:
            if entry.id == step_id:
                return entry
        raise KeyError(step_id)

    def _head(self) -> dict[str, Any]:
        return {
            "schema": JOURNAL_SCHEMA,
            "plan_id": self.plan_id,
            "state": str(self.state),
            "error": self.error,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "pid": self.pid,
        }

    def to_dict(self) -> dict[str, Any]:
        return {**self._head(), "plan": self.plan.to_dict(), "steps": [s.to_dict() for s in self.steps]}

    def save(self) -> None:
        """Write the journal atomically; the first save also writes the plan, to a file of its own."""
        self.updated_at = time.time()
        if not self._plan_saved:
            # the plan is the bulk of a journal and never changes during a run: written once
            atomic_write(plan_path(self.path), json.dumps(self.plan.to_dict(), default=str))
            self._plan_saved = True
        body = {**self._head(), "steps": [s.to_dict() for s in self.steps]}
        atomic_write(self.path, json.dumps(body, separators=(",", ":"), default=str) + "\n", sync_dir=False)
        self.writes += 1

    @classmethod
    def load(cls, path: Path) -> Journal:
        try:
            data = json.loads(path.read_text())
            plan_data = json.loads(_find_plan(path).read_text())
            if data.get("schema") != JOURNAL_SCHEMA:
                raise JournalError(f"{path}: not a gpumode journal (schema {data.get('schema')!r})")
            steps = [StepEntry(**{**s, "state": StepState(s["state"])}) for s in data["steps"]]
            return cls(
                path=path,
                plan_id=data["plan_id"],
                plan=plan_from_dict(plan_data),
                steps=steps,
                state=RunState(data["state"]),
                error=data.get("error"),
                created_at=data["created_at"],
                updated_at=data["updated_at"],
                pid=data.get("pid", 0),
                _plan_saved=True,
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise JournalError(f"{path}: unreadable journal: {exc}") from exc


def plan_path(journal_path: Path) -> Path:
    """Where the plan of the journal at ``journal_path`` is: ``<id>.plan.json`` next to ``<id>.json``."""
    return journal_path.with_name(journal_path.name.removesuffix(".json") + ".plan.json")


def _find_plan(journal_path: Path) -> Path:
    """The plan file, also where a crash in the middle of :meth:`JournalStore.archive` left it."""
    here = plan_path(journal_path)
    moved = [here.parent / "done" / here.name, here.parent.parent / here.name]
    return next((p for p in (here, *moved) if p.exists()), here)


def _is_plan_file(path: Path) -> bool:
    return path.name.endswith(".plan.json")


def plan_from_dict(data: dict[str, Any]) -> Plan:
    """Rebuild a :class:`Plan` from ``Plan.to_dict()`` (as stored in a journal)."""
    req = dict(data["request"])
    request = SwitchRequest(
        mode=Mode(req["mode"]),
        gpus=list(req.get("gpus", [])),
        vgpu_type=req.get("vgpu_type"),
        vgpu_count=req.get("vgpu_count"),
        passthrough_alias=req.get("passthrough_alias"),
        vm_policy=VmPolicy(req.get("vm_policy", VmPolicy.GPU)),
        restart_vms=bool(req.get("restart_vms", True)),
        allow_boot_vga=bool(req.get("allow_boot_vga", False)),
    )
    imp = dict(data.get("impact", {}))
    imp["gpus"] = {a: (Mode(now), Mode(after)) for a, (now, after) in imp.get("gpus", {}).items()}
    return Plan(
        hostname=data["hostname"],
        request=request,
        steps=[Step(**s) for s in data["steps"]],
        impact=Impact(**imp),
        snapshot_fingerprint=data.get("snapshot_fingerprint", ""),
    )


def atomic_write(path: Path, text: str, *, sync_dir: bool = True) -> None:
    """Replace ``path`` with ``text`` so that a crash leaves the old or the new content, never a mix.

    The file's data is always fsync'ed before the rename. ``sync_dir=False`` skips the fsync of the directory
    (which makes the rename itself durable across a power loss): a journal update lost that way leaves the
    journal one step behind, which resume handles by re-checking, and a power loss resets the kernel state the
    step changed anyway. Creating and archiving a journal always sync the directory.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if sync_dir:
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JournalStore:
    """The journals of one host."""

    def __init__(self, host: Host) -> None:
        self.dir = host.path(STATE_DIR, "journal")
        self.done_dir = self.dir / "done"

    def unfinished(self) -> Journal | None:
        """The journal of a run that did not finish (crashed, or stopped on failure), if any. Reads only."""
        if not self.dir.is_dir():
            return None
        paths = sorted(p for p in self.dir.glob("*.json") if p.is_file() and not _is_plan_file(p))
        if not paths:
            return None
        # the lock allows one run at a time, so there is at most one; if a crash left more, the newest counts
        return Journal.load(paths[-1])

    def create(self, plan: Plan, plan_id: str) -> Journal:
        steps = [StepEntry(id=s.id, action=s.action, target=s.target, where=s.where) for s in plan.steps]
        journal = Journal(path=self.dir / f"{plan_id}.json", plan_id=plan_id, plan=plan, steps=steps)
        journal.save()
        _fsync_dir(self.dir)
        return journal

    def archive(self, journal: Journal) -> None:
        """Move a finished journal out of the way (into ``done/``), so the next run does not resume it."""
        self.done_dir.mkdir(parents=True, exist_ok=True)
        target = self.done_dir / journal.path.name
        os.replace(journal.path, target)  # first: from here on the run is finished, wherever its plan is
        os.replace(plan_path(journal.path), plan_path(target))
        _fsync_dir(self.dir)
        journal.path = target

    def finished(self, plan_id: str) -> Journal | None:
        """The finished journal of run ``plan_id``, if it is still in ``done/``."""
        path = self.done_dir / f"{plan_id}.json"
        return Journal.load(path) if path.exists() else None

    def reopen(self, journal: Journal, why: str) -> Journal:
        """Make a finished journal unfinished again, rolling back (to undo a run after it ended).

        Crash-safe: the plan, then the journal (state ``rolling_back``) are written into the journal directory
        before the finished copy goes; a crash in between leaves an unfinished journal that rolls back, and
        the stale copy in ``done/`` is replaced when that rollback archives it.
        """
        done_path = journal.path
        target = self.dir / done_path.name
        atomic_write(plan_path(target), plan_path(done_path).read_text())
        journal.path = target
        journal.state = RunState.ROLLING_BACK
        journal.error = why
        journal.save()
        _fsync_dir(self.dir)
        done_path.unlink(missing_ok=True)
        plan_path(done_path).unlink(missing_ok=True)
        return journal

    def history(self, limit: int = 10) -> list[Journal]:
        if not self.done_dir.is_dir():
            return []
        paths = sorted(p for p in self.done_dir.glob("*.json") if not _is_plan_file(p))[-limit:]
        return [Journal.load(p) for p in paths]


class HostLock:
    """An exclusive ``flock`` on the host's engine lock file; the kernel drops it when the holder dies.

    A SIGKILLed runner therefore never leaves a stale lock behind, which is what makes ``--resume`` safe to
    run right after a crash.
    """

    def __init__(self, host: Host) -> None:
        self.path = host.path(STATE_DIR, "engine.lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise EngineBusy(
                f"another gpumode runner (pid {holder}) is working on this host; lock {self.path}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> HostLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
