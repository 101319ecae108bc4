"""Crashes and failures in the middle of a switch: the host is finished or put back, nothing is lost.

Kills are real: ``gpumode apply`` runs in a child process that SIGKILLs itself right before or right after
step N (``GPUMODE_FAULT_KILL``), then a restart resumes or rolls back. Failures: step N's host operation fails
(after doing part of its work, or before), and the host must come back to exactly what discovery showed
before.

The matrix is kept affordable: per fixture one transition that changes the driver (the longest plans), both
kill points; every host step on the small fixtures, the first step of each action on the large ones; resume
and rollback alternate, so each recovery path meets every kind of step across the fixtures.
"""

from __future__ import annotations

import errno
import signal
from pathlib import Path
from typing import Any

import pytest
from engine_support import (
    FIXTURES,
    fork_cli,
    gpus_without_driver,
    killed,
    make_host,
    orphan_mdevs,
    request_for,
    run_cli,
    view,
    vm_view,
)

from gpumode.domain import Mode, Plan
from gpumode.host.root import Host
from gpumode.modes import engine
from gpumode.modes.journal import Journal, JournalStore, RunState
from gpumode.modes.run import FAULT_ENV, Runner
from gpumode.modes.steps import StepContext, StepImpl, StepRegistry, default_registry

# the switch each fixture is tested with: away from its starting mode, through a driver change if possible
TARGETS = {
    "hgx-h100": Mode.PASSTHROUGH,
    "a16-vdi": Mode.ACCEL,
    "l40s-sriov": Mode.ACCEL,
    "t4-mdev": Mode.PASSTHROUGH,
    "rtx-workstation": Mode.ACCEL,
}


def target_plan(host: Host, fixture: str) -> tuple[Mode, Plan]:
    for mode in (TARGETS[fixture], Mode.VGPU, Mode.ACCEL, Mode.PASSTHROUGH):
        request = request_for(host, mode)
        if request is not None:
            return mode, engine.plan(host, request)
    raise AssertionError(f"{fixture}: no mode can be planned")


slow = pytest.mark.slow
SMALL = ("t4-mdev", "rtx-workstation")  # quick enough for every run; the others are marked slow


def request_args(plan: Plan) -> list[str]:
    """The CLI options that ask for ``plan``'s request."""
    req = plan.request
    return ["--mode", req.mode.value, *(["--vgpu-type", req.vgpu_type] if req.vgpu_type else [])]


def host_step_numbers(plan: Plan) -> list[int]:
    return [n for n, s in enumerate(plan.steps, 1) if s.where == "host"]


# How many host steps each small fixture's target plan has: the cases below are one per step, and
# test_every_host_step_has_its_cases fails (naming the new count) when the planner changes it.
HOST_STEPS = {"t4-mdev": 5, "rtx-workstation": 12}


def cases() -> list[Any]:
    """(fixture, step number, kill point) for the small fixtures: every host step, both kill points."""
    quick = {("t4-mdev", 2, "before"), ("t4-mdev", 3, "after")}  # the rest is marked slow
    return [
        pytest.param(
            fixture, n, point, id=f"{fixture}-{point}-{n}", marks=() if (fixture, n, point) in quick else slow
        )
        for fixture in SMALL
        for n in range(1, HOST_STEPS[fixture] + 1)
        for point in ("before", "after")
    ]


def first_step_of_each_action(host: Host, plan: Plan) -> list[int]:
    """Plan step numbers of the first host step of each action that really runs. On the large fixtures the
    same action on the next GPU runs the same code, so one kill per kind of step covers them at a fraction of
    the time. A run on ``host`` (a throwaway copy) tells which steps act: a kill point is only reached by a
    step that acts, not by one an earlier step already did (``modprobe -r`` taking ``nvidia`` along)."""
    result = engine.apply(host, plan.request)
    assert result.ok and result.run is not None, result.run.error if result.run else result
    ran = {e.id for e in result.run.steps if e.state.value == "done"}
    seen: dict[str, int] = {}
    for n, step in enumerate(plan.steps, 1):
        if step.where == "host" and step.id in ran:
            seen.setdefault(step.action, n)
    return sorted(seen.values())


def recorded_detaches(host: Host) -> dict[str, set[str]]:
    """Every device the journals say was taken out of a VM (done or unfinished)."""
    store = JournalStore(host)
    journals = [*store.history(limit=100)]
    unfinished = store.unfinished()
    if unfinished:
        journals.append(unfinished)
    out: dict[str, set[str]] = {}
    for j in journals:
        for entry in j.steps:
            if entry.action == "vm.detach_device" and "detached" in entry.record:
                d = entry.record["detached"]
                out.setdefault(entry.target, set()).add(f"{d['kind']}:{d['id']}")
    return out


def assert_nothing_lost(host: Host, before: dict[str, Any]) -> None:
    """No orphan mdev, no GPU that had a driver left without one, no VM device lost unrecorded."""
    assert not orphan_mdevs(host), "orphan mdevs"
    unbound_before = {a for a, (mode, *_) in before["gpus"].items() if mode == "none"}
    assert set(gpus_without_driver(host)) <= unbound_before, "a GPU was left without a driver"
    vms_before = before["vms"]
    recorded = recorded_detaches(host)
    for name, (_, devices) in vms_before.items():
        now = set(vm_view(host).get(name, (False, []))[1])
        lost = set(devices) - now
        assert lost <= recorded.get(name, set()), (
            f"VM {name} lost {lost - recorded.get(name, set())} unrecorded"
        )


@pytest.mark.parametrize("fixture", SMALL)
def test_every_host_step_has_its_cases(tmp_path: Path, fixture: str) -> None:
    host = make_host(tmp_path / "h", fixture)
    mode, plan = target_plan(host, fixture)
    assert len(host_step_numbers(plan)) == HOST_STEPS[fixture], f"the {mode.value} plan of {fixture} changed"


@pytest.mark.parametrize(("fixture", "n", "point"), cases())
def test_killed_runner_is_resumed_or_rolled_back(tmp_path: Path, fixture: str, n: int, point: str) -> None:
    host = make_host(tmp_path / "h", fixture)
    mode, plan = target_plan(host, fixture)
    steps = host_step_numbers(plan)
    kill_and_recover(host, mode, plan, steps[n - 1], point, resume=bool((n + (point == "after")) % 2))


@slow
@pytest.mark.parametrize("point", ["before", "after"])
@pytest.mark.parametrize("fixture", [f for f in FIXTURES if f not in SMALL])
def test_killed_runner_at_each_kind_of_step(tmp_path: Path, fixture: str, point: str) -> None:
    template = make_host(tmp_path / "template", fixture)
    mode, plan = target_plan(template, fixture)
    for i, step_no in enumerate(first_step_of_each_action(template, plan)):
        host = make_host(tmp_path / f"h{i}", fixture)
        kill_and_recover(host, mode, plan, step_no, point, resume=bool((i + (point == "after")) % 2))


def kill_and_recover(host: Host, mode: Mode, plan: Plan, step_no: int, point: str, *, resume: bool) -> None:
    """SIGKILL `gpumode apply` right before/after plan step ``step_no``, then resume or roll back: nothing
    lost. Resume and rollback alternate over the matrix, so each recovery path meets every kind of step."""
    before = view(host)
    status = fork_cli("apply", *request_args(plan), "--yes", "--root", str(host.root), env={
        FAULT_ENV: f"{point}:{step_no}"
    })  # fmt: skip
    assert killed(status), f"child was not killed (status {status}) at {point} step {step_no}"
    journal = JournalStore(host).unfinished()
    assert journal is not None and journal.state is RunState.RUNNING
    assert_nothing_lost_but_drivers(host, before["vms"])

    if resume:
        result = engine.resume(host)
        assert result is not None and result.ok, result.error if result else None
        assert not engine.assert_mode(host, mode)
    else:
        result = engine.rollback(host)
        assert result is not None and result.state is RunState.ROLLED_BACK, result.error if result else None
        assert view(host) == before, f"rollback after a kill {point} step {step_no} did not restore the host"
    assert JournalStore(host).unfinished() is None
    assert_nothing_lost(host, before)


def assert_nothing_lost_but_drivers(host: Host, vms_before: dict[str, tuple[bool, list[str]]]) -> None:
    """Right after a kill a GPU may legitimately be between drivers; VM devices must still be accounted
    for."""
    recorded = recorded_detaches(host)
    for name, (_, devices) in vms_before.items():
        lost = set(devices) - set(vm_view(host).get(name, (False, []))[1])
        assert lost <= recorded.get(name, set()), f"VM {name} lost {lost} without a journal record"


def test_cli_resume_after_a_real_kill(tmp_path: Path) -> None:
    """The whole operator path in fresh processes: apply is killed, a second apply is refused nothing, and
    `gpumode apply --resume` (the deprecated alias of `gpumode resume`) finishes the switch."""
    host = make_host(tmp_path / "h", "t4-mdev")
    mode, plan = target_plan(host, "t4-mdev")
    middle = host_step_numbers(plan)[len(host_step_numbers(plan)) // 2]
    root = str(host.root)
    proc = run_cli("apply", *request_args(plan), "--yes", "--root", root, env={FAULT_ENV: f"after:{middle}"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    st = run_cli("status", "--root", root)
    assert "unfinished run" in st.stdout
    proc = run_cli("apply", "--resume", "--root", root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert run_cli("assert", "--mode", mode.value, "--root", root).returncode == 0


def test_cli_rollback_after_a_real_kill(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    before = view(host)
    _, plan = target_plan(host, "t4-mdev")
    last = host_step_numbers(plan)[-1]
    root = str(host.root)
    proc = run_cli("apply", *request_args(plan), "--yes", "--root", root, env={FAULT_ENV: f"before:{last}"})
    assert proc.returncode == -signal.SIGKILL
    proc = run_cli("apply", "--rollback", "--root", root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert view(host) == before


def test_kill_during_rollback_then_rollback_again(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    before = view(host)
    _, plan = target_plan(host, "t4-mdev")
    steps = host_step_numbers(plan)
    status = fork_cli("apply", *request_args(plan), "--yes", "--root", str(host.root), env={
        FAULT_ENV: f"after:{steps[-1]}"
    })  # fmt: skip
    assert killed(status)
    status = fork_cli("apply", "--rollback", "--root", str(host.root), env={FAULT_ENV: f"undo:{steps[1]}"})
    assert killed(status)
    journal = JournalStore(host).unfinished()
    assert journal is not None and journal.state is RunState.ROLLING_BACK
    result = engine.resume(host)  # a journal that was rolling back keeps rolling back
    assert result is not None and result.state is RunState.ROLLED_BACK
    assert view(host) == before


# --- failures -----------------------------------------------------------------------------------------------


class FailAt:
    """Wraps a step: at the chosen step, apply does the real work and then fails (``after``), or fails before
    touching anything (``before``)."""

    def __init__(self, inner: StepImpl, step_id: str, when: str) -> None:
        self.inner, self.step_id, self.when = inner, step_id, when
        self.action = inner.action
        self.verify = getattr(inner, "verify", True)

    def check(self, host: Host, ctx: StepContext) -> bool:
        # never "already done" at the chosen step (an earlier step may have done its work, e.g. `modprobe -r`
        # taking nvidia along): the injected failure must fire
        return ctx.step.id != self.step_id and self.inner.check(host, ctx)

    def apply(self, host: Host, ctx: StepContext) -> None:
        if ctx.step.id == self.step_id and self.when == "before":
            raise OSError(errno.EIO, "injected failure before the step acted")
        self.inner.apply(host, ctx)
        if ctx.step.id == self.step_id:
            raise OSError(errno.EIO, "injected failure after the step acted")

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        self.inner.undo(host, ctx, record)


def failing_registry(step_id: str, action: str, when: str) -> StepRegistry:
    reg = default_registry()
    reg.add(FailAt(reg.get(action), step_id, when))  # type: ignore[arg-type]
    return reg


@pytest.mark.parametrize(
    "fixture", [pytest.param(f, marks=pytest.mark.slow) if f not in SMALL else f for f in FIXTURES]
)
def test_a_failure_at_any_step_puts_the_host_back(tmp_path: Path, fixture: str) -> None:
    host = make_host(tmp_path / "h", fixture)
    before = view(host)
    _, plan = target_plan(host, fixture)
    for k, n in enumerate(host_step_numbers(plan)):
        step = plan.steps[n - 1]
        when = ("after", "before")[k % 2]
        journal = JournalStore(host).create(plan, f"fail-{n:02d}")
        result = Runner(host, registry=failing_registry(step.id, step.action, when)).run(journal)
        assert result.state is RunState.ROLLED_BACK, f"step {step.id} ({when}): {result.error}"
        assert "injected failure" in (result.error or "")
        assert view(host) == before, f"failure at {step.id} ({when}) left the host changed"
        assert_nothing_lost(host, before)


def test_a_kernel_refusal_rolls_back(tmp_path: Path) -> None:
    """A real emulated-kernel error (EBUSY on a bind) in the middle of a passthrough switch."""
    from gpumode.emulated.kernel import EmulatedKernel

    host = make_host(tmp_path / "h", "rtx-workstation")
    before = view(host)
    _, plan = target_plan(host, "rtx-workstation")
    EmulatedKernel(host.root).inject_fault("sys/bus/pci/drivers_probe", errno.EBUSY, count=1)
    result = engine.apply(host, plan.request)
    assert result.run is not None and result.run.state is RunState.ROLLED_BACK, result.run
    assert view(host) == before


def test_no_rollback_stops_and_leaves_the_journal(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    mode, plan = target_plan(host, "t4-mdev")
    n = host_step_numbers(plan)[-1]
    step = plan.steps[n - 1]
    journal = JournalStore(host).create(plan, "stop-here")
    result = Runner(host, registry=failing_registry(step.id, step.action, "before")).run(
        journal, rollback_on_failure=False
    )
    assert result.state is RunState.STOPPED
    unfinished = JournalStore(host).unfinished()
    assert isinstance(unfinished, Journal) and unfinished.plan_id == "stop-here"
    # the next apply settles it first (resume), then runs its own plan
    outcome = engine.apply(host, plan.request)
    assert outcome.previous is not None and outcome.previous.ok
    assert outcome.ok and not engine.assert_mode(host, mode)


@pytest.mark.parametrize(
    ("fixture", "prefix"),
    [
        ("t4-mdev", "modprobe"),
        pytest.param("l40s-sriov", "apt-get install", marks=pytest.mark.slow),
        pytest.param("hgx-h100", "systemctl stop", marks=pytest.mark.slow),
    ],
)
def test_a_failing_command_rolls_back(tmp_path: Path, fixture: str, prefix: str) -> None:
    """The emulated userspace fails a real command the plan runs; the host is put back."""
    from gpumode.emulated.userspace import inject_command_fault, read_command_log

    host = make_host(tmp_path / "h", fixture)
    before = view(host)
    mode, plan = target_plan(host, fixture)
    inject_command_fault(host.root, prefix, returncode=100, stderr="E: injected")
    result = engine.apply(host, plan.request)
    faulted = [c for c in read_command_log(host.root) if c.get("fault")]
    if not faulted:
        pytest.skip(f"the {mode.value} plan of {fixture} runs no `{prefix}`")
    assert result.run is not None and result.run.state is RunState.ROLLED_BACK, result.run
    assert "injected" in (result.run.error or "")
    assert view(host) == before
