"""A run that cannot settle says exactly what is left, exits non-zero, and has a documented way out.

Success is verified: a rollback that ran every undo but left a device behind is not "rolled back"; the
journal stays, `gpumode journal show` compares the host with both ways out, and `gpumode journal abandon
--yes` gives the run up without touching the host.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

from engine_support import fork_cli, killed, make_host, run_cli, view
from test_faults import host_step_numbers, request_args, target_plan

from gpumode.domain import Mode
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.host.root import Host
from gpumode.modes import engine
from gpumode.modes.journal import JournalStore, RunState, StepState
from gpumode.modes.run import FAULT_ENV, Runner
from gpumode.modes.steps import StepContext, StepImpl, default_registry

T4_GPU = "0000:18:00.0"  # t4-mdev's first GPU: no driver (mode none) until the plan binds it to vfio-pci


class StuckUndo:
    """bind.vfio whose undo "succeeds" without moving the GPU: a device that will not come back."""

    action = "bind.vfio"

    def __init__(self, inner: StepImpl) -> None:
        self.inner = inner

    def check(self, host: Host, ctx: StepContext) -> bool:
        return self.inner.check(host, ctx)

    def apply(self, host: Host, ctx: StepContext) -> None:
        self.inner.apply(host, ctx)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        return None


def killed_after_first_bind(tmp_path: Path) -> Host:
    host = make_host(tmp_path / "h", "t4-mdev")
    _, plan = target_plan(host, "t4-mdev")
    bind_step = next(n for n in host_step_numbers(plan) if plan.steps[n - 1].action == "bind.vfio")
    status = fork_cli("apply", *request_args(plan), "--yes", "--root", str(host.root), env={
        FAULT_ENV: f"after:{bind_step}"
    })  # fmt: skip
    assert killed(status)
    return host


def test_a_rollback_that_leaves_a_device_behind_is_not_rolled_back(tmp_path: Path) -> None:
    host = killed_after_first_bind(tmp_path)
    journal = JournalStore(host).unfinished()
    assert journal is not None
    registry = default_registry()
    registry.add(StuckUndo(registry.get("bind.vfio")))  # type: ignore[arg-type]
    result = Runner(host, registry=registry, verify=engine._verifier(host, None)).rollback(journal)
    assert result.state is RunState.ROLLING_BACK, result
    stuck = f"{T4_GPU}: carries driver_override=vfio-pci in mode none"
    assert any(line.startswith(stuck) for line in result.left), result.left
    assert "every step was undone, but the host is not back" in (result.error or "")

    # the operator's view: exit 1, the stuck device named, the ways out named, no literal None
    proc = run_cli("apply", "--rollback", "--root", str(host.root))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert f"✘ {stuck}" in out, out
    assert "gpumode journal abandon --yes" in out and "None" not in out

    shown = run_cli("journal", "show", "--root", str(host.root))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    text = " ".join(shown.stdout.split())
    assert "rolling_back" in text and "to put the host back (`gpumode rollback`)" in text
    assert f"✘ {stuck}" in text

    refused = run_cli("journal", "abandon", "--root", str(host.root))
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert JournalStore(host).unfinished() is not None
    before = view(host)
    done = run_cli("journal", "abandon", "--yes", "--root", str(host.root))
    assert done.returncode == 0, done.stdout + done.stderr
    assert JournalStore(host).unfinished() is None
    assert view(host) == before  # abandoning touches nothing but the journal
    abandoned = JournalStore(host).finished(journal.plan_id)
    assert abandoned is not None and abandoned.state is RunState.ABANDONED
    assert "journal abandon --yes" in (abandoned.error or "")
    # from here the host is what discovery shows: a new switch plans from it
    assert run_cli("apply", "--mode", "passthrough", "--yes", "--root", str(host.root)).returncode == 0
    assert not engine.assert_mode(host, Mode.PASSTHROUGH)


def test_an_undo_the_kernel_refuses_exits_non_zero_naming_the_device(tmp_path: Path) -> None:
    host = killed_after_first_bind(tmp_path)
    EmulatedKernel(host.root).inject_fault("sys/bus/pci/drivers/vfio-pci/unbind", errno.EBUSY, count=20)
    proc = run_cli("apply", "--rollback", "--root", str(host.root))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "rollback incomplete" in out and T4_GPU in out and "None" not in out, out
    EmulatedKernel(host.root).clear_faults()
    proc = run_cli("apply", "--rollback", "--root", str(host.root))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_journal_show_without_a_run(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    proc = run_cli("journal", "show", "--root", str(host.root))
    assert proc.returncode == 1 and "no unfinished run" in proc.stdout
    proc = run_cli("journal", "abandon", "--yes", "--root", str(host.root))
    assert proc.returncode == 1 and "nothing to abandon" in proc.stdout


def test_after_a_resume_durations_count_from_the_resume(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    _, plan = target_plan(host, "t4-mdev")
    middle = host_step_numbers(plan)[len(host_step_numbers(plan)) // 2]
    assert killed(fork_cli("apply", *request_args(plan), "--yes", "--root", str(host.root), env={
        FAULT_ENV: f"after:{middle}"
    }))  # fmt: skip
    resumed_at = time.time()
    result = engine.resume(host)
    assert result is not None and result.ok, result
    entry = result.steps[middle - 1]
    assert entry.state is StepState.DONE and entry.note == "done before the restart"
    assert entry.started_at is not None and entry.started_at >= resumed_at


def test_undone_steps_are_reported_in_the_order_they_ran(tmp_path: Path) -> None:
    host = killed_after_first_bind(tmp_path)
    result = engine.rollback(host)
    assert result is not None and result.state is RunState.ROLLED_BACK, result
    touched = [e.id for e in result.steps if e.touched]
    assert result.undone == list(reversed(touched)) and result.undone
