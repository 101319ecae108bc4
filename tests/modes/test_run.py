"""The runner and its journal, with simple file-setting steps (no emulated host needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from gpumode.domain import Impact, Mode, Plan, Step, SwitchRequest
from gpumode.host.root import Host
from gpumode.modes.journal import (
    EngineBusy,
    HostLock,
    Journal,
    JournalStore,
    RunState,
    StepState,
    plan_from_dict,
)
from gpumode.modes.run import ProgressEvent, Runner
from gpumode.modes.steps import StepContext, StepError, StepRegistry


class SetFile:
    """Sets ``<root>/<target>`` to ``params['value']``; undo puts the previous content back."""

    action: ClassVar[str] = "file.set"

    def check(self, host: Host, ctx: StepContext) -> bool:
        path = host.path(ctx.step.target)
        return path.exists() and path.read_text() == ctx.param("value")

    def apply(self, host: Host, ctx: StepContext) -> None:
        path = host.path(ctx.step.target)
        ctx.remember(previous=path.read_text() if path.exists() else None)
        path.write_text(ctx.param("value"))

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        if "previous" not in record:
            return
        path = host.path(ctx.step.target)
        if record["previous"] is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(record["previous"])


class Fail:
    action: ClassVar[str] = "fail"

    def check(self, host: Host, ctx: StepContext) -> bool:
        return False

    def apply(self, host: Host, ctx: StepContext) -> None:
        raise OSError(16, "Device or resource busy")

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        pass


class Lie:
    """Returns from apply without doing anything: the runner must notice."""

    action: ClassVar[str] = "lie"

    def check(self, host: Host, ctx: StepContext) -> bool:
        return False

    def apply(self, host: Host, ctx: StepContext) -> None:
        pass

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        pass


class UndoFails(SetFile):
    action: ClassVar[str] = "file.set-sticky"

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        raise StepError("cannot undo this one")


def registry() -> StepRegistry:
    reg = StepRegistry()
    for impl in (SetFile(), Fail(), Lie(), UndoFails()):
        reg.add(impl)
    return reg


def make_plan(*steps: tuple[str, str, dict[str, Any]] | tuple[str, str, dict[str, Any], str]) -> Plan:
    out = []
    for n, spec in enumerate(steps, 1):
        action, target, params = spec[0], spec[1], spec[2]
        where = spec[3] if len(spec) == 4 else "host"
        out.append(Step(id=f"{n:02d}-{action}", action=action, target=target, params=params, where=where))
    return Plan("h", SwitchRequest(Mode.ACCEL), out, Impact(gpus={"0000:3b:00.0": (Mode.NONE, Mode.ACCEL)}))


def start(host: Host, plan: Plan) -> Journal:
    return JournalStore(host).create(plan, "test-plan")


def test_runs_every_step_and_archives_the_journal(tmp_path: Path) -> None:
    host = Host(tmp_path)
    events: list[ProgressEvent] = []
    plan = make_plan(("file.set", "a", {"value": "1"}), ("file.set", "b", {"value": "2"}))
    result = Runner(host, registry=registry(), progress=events.append).run(start(host, plan))
    assert result.ok
    assert (tmp_path / "a").read_text() == "1" and (tmp_path / "b").read_text() == "2"
    assert [s.state for s in result.steps] == [StepState.DONE, StepState.DONE]
    assert JournalStore(host).unfinished() is None
    assert result.journal_path.parent.name == "done"
    assert [(e.index, e.state) for e in events] == [
        (0, StepState.STARTED),
        (0, StepState.DONE),
        (1, StepState.STARTED),
        (1, StepState.DONE),
    ]


def test_a_step_already_done_is_skipped_and_never_undone(tmp_path: Path) -> None:
    host = Host(tmp_path)
    (tmp_path / "a").write_text("1")
    plan = make_plan(("file.set", "a", {"value": "1"}), ("fail", "x", {}))
    result = Runner(host, registry=registry()).run(start(host, plan))
    assert result.state is RunState.ROLLED_BACK
    assert result.steps[0].state is StepState.SKIPPED
    assert (tmp_path / "a").read_text() == "1"  # was there before: rollback leaves it


def test_failure_rolls_back_in_reverse_order(tmp_path: Path) -> None:
    host = Host(tmp_path)
    (tmp_path / "a").write_text("old")
    plan = make_plan(
        ("file.set", "a", {"value": "new"}), ("file.set", "b", {"value": "2"}), ("fail", "x", {})
    )
    events: list[ProgressEvent] = []
    result = Runner(host, registry=registry(), progress=events.append).run(start(host, plan))
    assert result.state is RunState.ROLLED_BACK
    assert "Device or resource busy" in (result.error or "")
    assert (tmp_path / "a").read_text() == "old"
    assert not (tmp_path / "b").exists()
    undone = [e.index for e in events if e.phase == "undo" and e.state is StepState.UNDONE]
    assert undone == [2, 1, 0]


def test_apply_that_shows_no_effect_fails(tmp_path: Path) -> None:
    host = Host(tmp_path)
    result = Runner(host, registry=registry()).run(start(host, make_plan(("lie", "x", {}))))
    assert result.state is RunState.ROLLED_BACK
    assert "does not show it done" in (result.error or "")


def test_unknown_action_fails_cleanly(tmp_path: Path) -> None:
    host = Host(tmp_path)
    plan = make_plan(("file.set", "a", {"value": "1"}), ("warp.drive", "x", {}))
    result = Runner(host, registry=registry()).run(start(host, plan))
    assert result.state is RunState.ROLLED_BACK
    assert "no step implementation for action 'warp.drive'" in (result.error or "")
    assert not (tmp_path / "a").exists()


def test_no_rollback_stops_and_resume_finishes(tmp_path: Path) -> None:
    host = Host(tmp_path)
    plan = make_plan(("file.set", "a", {"value": "1"}), ("file.set", "b", {"value": "2"}))
    reg = registry()
    reg.add(Fail())

    class FailOnce(SetFile):
        calls = 0

        def apply(self, host: Host, ctx: StepContext) -> None:
            FailOnce.calls += 1
            if FailOnce.calls == 2:
                raise OSError(5, "Input/output error")
            super().apply(host, ctx)

    reg.add(FailOnce())
    result = Runner(host, registry=reg).run(start(host, plan), rollback_on_failure=False)
    assert result.state is RunState.STOPPED
    assert (tmp_path / "a").read_text() == "1" and not (tmp_path / "b").exists()
    journal = JournalStore(host).unfinished()
    assert journal is not None and journal.state is RunState.STOPPED
    assert journal.steps[1].state is StepState.FAILED
    result = Runner(host, registry=reg).run(journal)
    assert result.ok and (tmp_path / "b").read_text() == "2"


def test_a_started_step_found_done_on_resume_stays_undoable(tmp_path: Path) -> None:
    """The crash came after apply, before the journal said done: resume marks it done, rollback undoes it."""
    host = Host(tmp_path)
    plan = make_plan(("file.set", "a", {"value": "1"}), ("file.set", "b", {"value": "2"}))
    journal = start(host, plan)
    journal.steps[0].state, journal.steps[0].touched = StepState.STARTED, True
    journal.steps[0].record = {"previous": None}
    journal.save()
    (tmp_path / "a").write_text("1")  # the step's effect, made before the "crash"
    journal = JournalStore(host).unfinished()
    assert journal is not None
    result = Runner(host, registry=registry()).rollback(journal)
    assert result.state is RunState.ROLLED_BACK
    assert not (tmp_path / "a").exists()


def test_remember_keeps_what_the_first_attempt_saw(tmp_path: Path) -> None:
    host = Host(tmp_path)
    (tmp_path / "a").write_text("orig")
    plan = make_plan(("file.set", "a", {"value": "new"}))
    journal = start(host, plan)
    journal.steps[0].state, journal.steps[0].touched = StepState.STARTED, True
    journal.steps[0].record = {"previous": "orig"}
    journal.save()
    (tmp_path / "a").write_text("half")  # a half-done first attempt
    result = Runner(host, registry=registry()).run(JournalStore(host).unfinished())  # type: ignore[arg-type]
    assert result.ok and result.steps[0].record == {"previous": "orig"}


def test_cloud_steps_are_skipped_and_recorded(tmp_path: Path) -> None:
    host = Host(tmp_path)
    plan = make_plan(("file.set", "a", {"value": "1"}), ("cloud.register_cards", "h", {}, "cloud"))
    result = Runner(host, registry=registry()).run(start(host, plan))
    assert result.ok
    assert result.steps[1].state is StepState.SKIPPED and "cloud" in (result.steps[1].note or "")


def test_failed_undo_leaves_the_journal_unfinished(tmp_path: Path) -> None:
    host = Host(tmp_path)
    plan = make_plan(
        ("file.set-sticky", "a", {"value": "1"}), ("file.set", "b", {"value": "2"}), ("fail", "x", {})
    )
    result = Runner(host, registry=registry()).run(start(host, plan))
    assert result.state is RunState.STOPPED
    assert result.undo_errors and "cannot undo this one" in result.undo_errors[0]
    assert not (tmp_path / "b").exists()  # the other undo still ran
    assert JournalStore(host).unfinished() is not None


def test_journal_round_trips_the_plan(tmp_path: Path) -> None:
    host = Host(tmp_path)
    plan = make_plan(("file.set", "a", {"value": "1"}))
    journal = start(host, plan)
    loaded = Journal.load(journal.path)
    assert loaded.plan == plan
    assert plan_from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_corrupt_journal_is_named_in_the_error(tmp_path: Path) -> None:
    host = Host(tmp_path)
    bad = tmp_path / "var/lib/gpumode/journal/x.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    with pytest.raises(Exception, match=r"x\.json: unreadable journal"):
        JournalStore(host).unfinished()


def test_lock_allows_one_runner_and_dies_with_its_holder(tmp_path: Path) -> None:
    host = Host(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; from gpumode.host.root import Host; from gpumode.modes.journal import HostLock;"
            "HostLock(Host(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(EngineBusy, match=f"pid {holder.pid}"):
            HostLock(host).acquire()
    finally:
        holder.kill()
        holder.wait()
    with HostLock(host):  # the kernel dropped the dead holder's lock
        pass
    assert os.path.exists(tmp_path / "var/lib/gpumode/engine.lock")


def test_step_entry_serialises_every_field() -> None:
    from dataclasses import fields

    from gpumode.modes.journal import StepEntry

    entry = StepEntry(id="01-x", action="x", target="t", where="host")
    assert set(entry.to_dict()) == {f.name for f in fields(StepEntry)}
