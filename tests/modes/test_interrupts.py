"""Interrupted INSIDE a step: a signal lands while the step's external command runs.

The emulated userspace sends the signal from within the command (``gpumode.emulated.interrupts``) at its
start, in its middle (each tool's own halfway point: ``sriov-manage`` with the PF still on pci-pf-stub, apt
with one package done, systemd with the daemon up but the unit not yet active) or just before it returns.
``gpumode apply`` runs in a forked child. SIGINT must let the command finish and stop at the step
boundary, saying so; SIGKILL leaves whatever the command had done. Then the interrupted host is copied
twice: one copy is resumed, the other rolled back, and each must end in the state it claims (``assert``,
lspci's drivers, no orphan mdev, no VM that lost a device without a record).

A single kernel write (a blocking ``nvidia/unbind``) is one system call: the process is killed before it or
after it, never inside, which is what the step-boundary kill points of ``test_faults.py`` cover.

The whole matrix (every command-running action of the plans below × 3 points × SIGINT/SIGKILL) takes about
40 minutes here; CI runs a seeded sample of :data:`SAMPLE` cases. ``GPUMODE_INTERRUPT_MATRIX=all`` runs all of
it, ``GPUMODE_INTERRUPT_SEED=N`` picks another sample (the seed is in every case's id, so a failure names it).
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest
from engine_support import (
    check_drivers_with_lspci,
    fork_cli,
    killed,
    make_host,
    orphan_mdevs,
    run_cli,
    view,
)
from test_faults import assert_nothing_lost, assert_nothing_lost_but_drivers, request_args

from gpumode.domain import Mode, Plan, Step, SwitchRequest
from gpumode.emulated.interrupts import SIGNALS_FILE, inject_command_signal, signal_point
from gpumode.emulated.userspace import read_command_log
from gpumode.host.driverops import INSTALLERS
from gpumode.host.root import EMULATION_MARKER, Host
from gpumode.modes import engine
from gpumode.modes.journal import JournalStore, RunState, StepState
from gpumode.modes.policy import RequestError
from host_templates import active, copy_host

# (host template, target mode): the plans whose commands are interrupted
PLANS: dict[str, tuple[str, Mode]] = {
    "rtx-workstation": ("rtx-workstation", Mode.ACCEL),
    "l40s-sriov": ("l40s-sriov", Mode.ACCEL),
    "l40s-passthrough": ("l40s-sriov+passthrough", Mode.VGPU),
    "t4-mdev": ("t4-mdev", Mode.PASSTHROUGH),
    "a16-vdi": ("a16-vdi", Mode.ACCEL),
    "hgx-h100": ("hgx-h100", Mode.PASSTHROUGH),
}
# the actions that run an external command, per plan (test_matrix_covers_every_command_action keeps it true)
ACTIONS: dict[str, tuple[str, ...]] = {
    "rtx-workstation": ("driver.install", "module.load", "service.start", "command.run"),
    "l40s-sriov": (
        "service.stop", "sriov.disable", "module.unload", "driver.remove", "driver.install", "module.load",
        "service.start", "command.run",
    ),
    "l40s-passthrough": ("service.stop", "sriov.enable", "service.start"),
    "t4-mdev": ("module.load",),
    "a16-vdi": (
        "service.stop", "sriov.disable", "module.unload", "driver.remove", "driver.install", "module.load",
        "service.start", "command.run",
    ),
    "hgx-h100": ("service.stop", "module.load", "service.start"),
}  # fmt: skip
# actions whose command has a middle (modprobe without -r loads in one go; nvidia-ctk writes one file)
HAS_MIDDLE = frozenset({"service.stop", "service.start", "sriov.disable", "sriov.enable", "module.unload"})
POINTS = ("start", "middle", "end")
SIGNALS = ("SIGINT", "SIGKILL")
SAMPLE = 6
# cases that found a bug once, run every time besides the sample
ALWAYS = (("rtx-workstation", "service.start", "middle", "SIGKILL"),)  # a daemon up, its unit not yet active
HEAVY = frozenset({"a16-vdi", "hgx-h100"})  # only in the whole matrix: the same actions, 4× the functions


def _middle(plan_name: str, action: str) -> bool:
    if action in HAS_MIDDLE:
        return True
    # apt's middle lies between two packages
    return action in ("driver.install", "driver.remove") and plan_name != "rtx-workstation"


def all_cases() -> list[tuple[str, str, str, str]]:
    return [
        (plan_name, action, point, sig)
        for plan_name, actions in ACTIONS.items()
        for action in actions
        for point in POINTS
        if point != "middle" or _middle(plan_name, action)
        for sig in SIGNALS
    ]


def chosen_cases() -> list[Any]:
    cases = all_cases()
    if os.environ.get("GPUMODE_INTERRUPT_MATRIX") == "all":
        return [pytest.param(*c, id="-".join(c)) for c in cases]
    seed = int(os.environ.get("GPUMODE_INTERRUPT_SEED", "12"))
    light = [c for c in cases if c[0] not in HEAVY]
    # a middle point and a SIGKILL are where partial states come from: the sample always has some of each
    rng = random.Random(seed)
    middles = [c for c in light if c[2] == "middle" and c[3] == "SIGKILL"]
    picked = rng.sample(middles, SAMPLE // 2)
    picked += rng.sample([c for c in light if c not in picked], SAMPLE - len(picked))
    sample = [pytest.param(*c, id=f"seed{seed}-" + "-".join(c)) for c in sorted(picked)]
    return sample + [pytest.param(*c, id="always-" + "-".join(c)) for c in ALWAYS if c not in picked]


def template_host(directory: Path, template: str) -> Host:
    """A copy of ``template``: a fixture, or ``fixture+mode`` (the fixture switched to that mode once)."""
    fixture, _, mode = template.partition("+")
    if not mode:
        return make_host(directory, fixture)

    def build(root: Path) -> None:
        host = make_host(root, fixture)
        result = engine.apply(host, SwitchRequest(Mode(mode)))
        assert result.ok, result.run.error if result.run else result

    return Host(active().copy(template, build, directory))


def target_plan(host: Host, mode: Mode) -> Plan:
    request = SwitchRequest(mode)
    try:
        return engine.plan(host, request)
    except RequestError as exc:  # vgpu without a type: the first one offered, as an operator would pick
        assert exc.code == "vgpu_type_required" and exc.choices, exc
        return engine.plan(host, SwitchRequest(mode, vgpu_type=exc.choices[0]))


def command_of(step: Step) -> str:
    """The argv prefix of the command ``step`` runs (what the signal is aimed at)."""
    action, target = step.action, step.target
    if action.startswith("sriov."):
        return " ".join(step.params["argv"])
    if action.startswith("service."):
        return f"systemctl {action.split('.')[1]} {target}"
    if action == "module.load":
        return f"modprobe {target}"
    if action == "module.unload":
        return f"modprobe -r {target}"
    if action.startswith("driver."):
        tool = INSTALLERS[step.params["installer"]]
        return " ".join(tool.install if action == "driver.install" else tool.remove)
    if action == "command.run":
        return " ".join(step.params["argv"])
    raise AssertionError(f"{action} runs no command")


def first_step(plan: Plan, action: str) -> Step:
    for step in plan.steps:
        if step.where == "host" and step.action == action:
            return step
    raise AssertionError(f"the plan has no {action} step (ACTIONS is out of date)")


def signal_fired(host: Host) -> bool:
    return not (host.root / EMULATION_MARKER / SIGNALS_FILE).exists()


@pytest.mark.slow
@pytest.mark.interrupts
@pytest.mark.parametrize("plan_name", [p for p in PLANS if p not in HEAVY])
def test_matrix_covers_every_command_action(tmp_path: Path, plan_name: str) -> None:
    template, mode = PLANS[plan_name]
    host = template_host(tmp_path / "h", template)
    plan = target_plan(host, mode)
    running = {s.action for s in plan.steps if s.where == "host"} & {
        "service.stop", "service.start", "sriov.enable", "sriov.disable", "module.load", "module.unload",
        "driver.install", "driver.remove", "command.run",
    }  # fmt: skip
    assert running == set(ACTIONS[plan_name]), f"{plan_name}: the plan's command actions changed"


@pytest.mark.slow
@pytest.mark.interrupts
@pytest.mark.parametrize(("plan_name", "action", "point", "sig"), chosen_cases())
def test_interrupted_inside_a_command(
    tmp_path: Path, plan_name: str, action: str, point: str, sig: str
) -> None:
    template, mode = PLANS[plan_name]
    host = template_host(tmp_path / "h", template)
    before = view(host)
    plan = target_plan(host, mode)
    step = first_step(plan, action)
    inject_command_signal(host.root, command_of(step), point, sig)
    status = fork_cli("apply", *request_args(plan), "--yes", "--root", str(host.root), env={})
    assert signal_fired(host), f"`{command_of(step)}` never reached its {point}"
    journal = JournalStore(host).unfinished()
    assert journal is not None
    if sig == "SIGKILL":
        assert killed(status), f"status {status}"
    else:
        # the command and its step finished; the run stopped right after, saying so
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 130, f"status {status}"
        assert journal.state is RunState.STOPPED and "interrupted by SIGINT" in (journal.error or "")
        assert journal.entry(step.id).state in (StepState.DONE, StepState.SKIPPED), journal.entry(step.id)
    assert_nothing_lost_but_drivers(host, before["vms"])

    resumed = Host(copy_host(host.root, tmp_path / "resumed"))
    result = engine.resume(resumed)
    assert result is not None and result.ok, result.error if result else None
    assert not engine.assert_mode(resumed, mode), engine.assert_mode(resumed, mode)
    assert not check_drivers_with_lspci(resumed, mode)
    assert not orphan_mdevs(resumed)
    assert_nothing_lost(resumed, before)

    rolled = Host(copy_host(host.root, tmp_path / "rolled"))
    result = engine.rollback(rolled)
    assert result is not None and result.state is RunState.ROLLED_BACK, result.error if result else None
    assert view(rolled) == before, f"rollback after {sig} at the {point} of {command_of(step)} left changes"
    assert_nothing_lost(rolled, before)


# --- the cases from the issue -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.interrupts
def test_sriov_manage_killed_halfway_leaves_nothing_that_blocks(tmp_path: Path) -> None:
    """passthrough → vgpu on l40s-sriov, `sriov-manage -e` killed with the PF on pci-pf-stub and its id in
    pci-pf-stub's dynamic ids: resume, rollback and a new switch all work (no "already matches" error)."""
    host = template_host(tmp_path / "h", "l40s-sriov+passthrough")
    plan = target_plan(host, Mode.VGPU)
    step = first_step(plan, "sriov.enable")
    inject_command_signal(host.root, "sriov-manage -e", "middle", "SIGKILL")
    assert killed(fork_cli("apply", *request_args(plan), "--yes", "--root", str(host.root), env={}))
    assert (host.root / "sys/bus/pci/devices" / step.target / "driver").resolve().name == "pci-pf-stub"

    again = Host(copy_host(host.root, tmp_path / "again"))
    proc = run_cli("apply", "--mode", "accel", "--yes", "--root", str(again.root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not engine.assert_mode(again, Mode.ACCEL)

    rolled = Host(copy_host(host.root, tmp_path / "rolled"))
    proc = run_cli("apply", "--rollback", "--root", str(rolled.root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "None" not in proc.stdout
    assert not engine.assert_mode(rolled, Mode.PASSTHROUGH)


def test_ctrl_c_inside_a_command_says_where_it_stopped(tmp_path: Path) -> None:
    """A real `gpumode apply` process gets SIGINT while `modprobe vfio_pci` runs: modprobe finishes, the run
    stops after that step and says which commands finish or undo it; exit 130."""
    host = make_host(tmp_path / "h", "t4-mdev")
    inject_command_signal(host.root, "modprobe vfio_pci", "start", "SIGINT")
    proc = run_cli("apply", "--mode", "passthrough", "--yes", "--root", str(host.root))
    assert proc.returncode == 130, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "interrupted (SIGINT)" in out and "after step 01-module.load-vfio_pci" in out, out
    assert "`gpumode resume` finishes it" in out and "`gpumode rollback` undoes it" in out
    journal = JournalStore(host).unfinished()
    assert journal is not None and journal.steps[0].state is StepState.DONE
    assert [c["argv"] for c in read_command_log(host.root)][-1] == ["modprobe", "vfio_pci"]
    proc = run_cli("apply", "--resume", "--root", str(host.root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert run_cli("assert", "--mode", "passthrough", "--root", str(host.root)).returncode == 0


# --- the signal points themselves ---------------------------------------------------------------------------


def test_a_signal_point_fires_once_for_its_command_only(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / EMULATION_MARKER).mkdir(parents=True)
    caught: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: caught.append(signum))
    try:
        inject_command_signal(root, "sriov-manage -e", "middle", "SIGTERM")
        from gpumode.emulated.interrupts import current_command

        with current_command(("/usr/lib/nvidia/sriov-manage", "-d", "0000:17:00.0")):
            signal_point(root, "middle")  # another command: nothing
        with current_command(("/usr/lib/nvidia/sriov-manage", "-e", "0000:17:00.0")):
            signal_point(root, "start")  # another point: nothing
            assert not caught
            signal_point(root, "middle")
            signal_point(root, "middle")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert caught == [signal.SIGTERM]
    assert not (root / EMULATION_MARKER / SIGNALS_FILE).exists()


@pytest.mark.parametrize(
    ("prefix", "point", "sig", "why"),
    [
        ("", "start", "SIGINT", "prefix"),
        ("ls", "later", "SIGINT", "point"),
        ("ls", "end", "SIGHUP", "signal"),
    ],
)
def test_a_bad_signal_point_is_refused(tmp_path: Path, prefix: str, point: str, sig: str, why: str) -> None:
    (tmp_path / EMULATION_MARKER).mkdir()
    with pytest.raises(ValueError, match=why):
        inject_command_signal(tmp_path, prefix, point, sig)
    assert not (tmp_path / EMULATION_MARKER / SIGNALS_FILE).exists()


def test_sample_is_reproducible_and_mixed() -> None:
    ids = [json.dumps(p.values) for p in chosen_cases()]
    assert ids == [json.dumps(p.values) for p in chosen_cases()]
    values = [p.values for p in chosen_cases()]
    if os.environ.get("GPUMODE_INTERRUPT_MATRIX") != "all":
        assert SAMPLE <= len(values) <= SAMPLE + len(ALWAYS)
        assert any(v[2] == "middle" and v[3] == "SIGKILL" for v in values)


def test_a_command_runs_in_its_own_process_group() -> None:
    """A Ctrl-C at the terminal goes to the foreground process group: gpumode's, not the command's."""
    result = Host("/").run(["sh", "-c", "ps -o pgid= -p $$"], check=True)
    assert int(result.stdout.strip()) != os.getpgrp()


@pytest.mark.slow
@pytest.mark.interrupts
def test_sriov_steps_work_without_sriov_manage(tmp_path: Path) -> None:
    """The tool gone (removed with the vGPU manager, as in a rollback after `driver.remove`): the sriov steps
    change the VF count with gpumode's own kernel writes, and the host ends in the mode asked for."""
    host = template_host(tmp_path / "h", "l40s-sriov+passthrough")
    plan = target_plan(host, Mode.VGPU)
    tool = first_step(plan, "sriov.enable").params["argv"][0]
    host.path(tool).unlink()
    ran_before = len(read_command_log(host.root))
    result = engine.apply(host, plan.request)
    assert result.ok, result.run.error if result.run else result
    assert not engine.assert_mode(host, Mode.VGPU)
    ran = read_command_log(host.root)[ran_before:]
    assert not [c for c in ran if "sriov-manage" in str(c["argv"])], "the missing tool was called"
