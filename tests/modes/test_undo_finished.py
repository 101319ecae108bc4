"""Undoing a run that finished ``done`` (the agent does it when a job's cloud steps failed for good), on an
emulated host: the host, its desired state and its journals end as if the run had been rolled back, also when
the undo is interrupted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_support import make_host, view

from gpumode.domain import Mode, SwitchRequest, VmPolicy
from gpumode.host.root import Host
from gpumode.modes import engine
from gpumode.modes.desired import desired_path, undo_success
from gpumode.modes.journal import JournalStore, RunState


def switched(tmp_path: Path) -> tuple[Host, list[str], dict[str, Any], dict[str, Any]]:
    """A t4-mdev host that ran a vGPU switch, then a passthrough switch: the host, both runs' ids, the host
    as it was between the two and its desired GPUs then."""
    host = make_host(tmp_path / "host", "t4-mdev")
    first = engine.apply(host, SwitchRequest(mode=Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2))
    assert first.ok and first.run is not None, first
    before, desired = view(host), desired_gpus(host)
    second = engine.apply(host, SwitchRequest(mode=Mode.PASSTHROUGH, vm_policy=VmPolicy.ALL))
    assert second.ok and second.run is not None, second
    assert view(host) != before and desired_gpus(host) != desired
    return host, [first.run.plan_id, second.run.plan_id], before, desired


def desired_gpus(host: Host) -> dict[str, Any]:
    gpus: dict[str, Any] = json.loads(desired_path(host).read_text())["gpus"]
    return gpus


def test_undo_puts_the_host_and_its_desired_state_back(tmp_path: Path) -> None:
    host, (_, plan_id), before, desired = switched(tmp_path)
    run = engine.undo_finished(host, plan_id)
    assert run.state is RunState.ROLLED_BACK, run.error
    assert view(host) == before and desired_gpus(host) == desired
    store = JournalStore(host)
    journal = store.finished(plan_id)
    assert store.unfinished() is None and journal is not None and journal.state is RunState.ROLLED_BACK
    assert "undone" in {e.state.value for e in journal.steps}
    # asked again (the agent's report of it was lost): nothing more happens
    assert engine.undo_finished(host, plan_id).state is RunState.ROLLED_BACK
    assert view(host) == before and desired_gpus(host) == desired


def test_an_undo_interrupted_after_the_reopen_is_finished_by_the_next_call(tmp_path: Path) -> None:
    host, (_, plan_id), before, desired = switched(tmp_path)
    store = JournalStore(host)
    journal = store.finished(plan_id)
    assert journal is not None
    assert undo_success(host, plan_id) and not undo_success(host, plan_id)  # once only
    store.reopen(journal, "undoing a finished run")  # ... and the process died here
    reopened = store.unfinished()
    assert store.finished(plan_id) is None and reopened is not None
    assert reopened.state is RunState.ROLLING_BACK
    run = engine.undo_finished(host, plan_id)
    assert run.state is RunState.ROLLED_BACK, run.error
    assert view(host) == before and desired_gpus(host) == desired


def test_refused_for_an_unknown_run_and_while_another_run_is_unfinished(tmp_path: Path) -> None:
    host, (first, second), _, _ = switched(tmp_path)
    with pytest.raises(engine.EngineError, match="no finished run nope"):
        engine.undo_finished(host, "nope")
    store = JournalStore(host)
    older = store.finished(first)
    assert older is not None
    store.reopen(older, "left unfinished")
    with pytest.raises(engine.EngineError, match=f"run {first} is unfinished on this host"):
        engine.undo_finished(host, second)
    assert store.finished(second) is not None  # nothing was touched
