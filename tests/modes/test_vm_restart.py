"""VMs a switch shut down are started again when they keep all their devices (on by default); those that lost
a device stay stopped and are listed in the plan's impact."""

from __future__ import annotations

import json
from pathlib import Path

from engine_support import make_host, run_cli, vm_view

from gpumode.domain import Mode, SwitchRequest, VmPolicy
from gpumode.host.root import Host
from gpumode.host.vms import open_hypervisor
from gpumode.modes import engine
from gpumode.modes.journal import RunState


def workstation_with_a_bystander(tmp_path: Path) -> Host:
    """rtx-workstation (its GPU passed through to win11-cad, running) plus a running VM with no GPU device."""
    host = make_host(tmp_path / "h", "rtx-workstation")
    hv = open_hypervisor(host)
    hv.define("build-box", [])  # type: ignore[attr-defined]
    hv.start("build-box")
    return host


def test_the_plan_says_which_vms_come_back(tmp_path: Path) -> None:
    host = workstation_with_a_bystander(tmp_path)
    plan = engine.plan(host, SwitchRequest(Mode.ACCEL, vm_policy=VmPolicy.ALL))
    assert sorted(plan.impact.vms_stopped) == ["build-box", "win11-cad"]
    assert plan.impact.vms_restarted == ["build-box"]
    assert plan.impact.vms_left_stopped == ["win11-cad"]
    host_steps = [s for s in plan.steps if s.where == "host"]
    assert (host_steps[-1].action, host_steps[-1].target) == ("vm.start", "build-box")
    off = engine.plan(host, SwitchRequest(Mode.ACCEL, vm_policy=VmPolicy.ALL, restart_vms=False))
    assert off.impact.vms_restarted == [] and not [s for s in off.steps if s.action == "vm.start"]


def test_a_vm_that_kept_its_devices_runs_again_after_the_switch(tmp_path: Path) -> None:
    host = workstation_with_a_bystander(tmp_path)
    result = engine.apply(host, SwitchRequest(Mode.ACCEL, vm_policy=VmPolicy.ALL))
    assert result.ok, result.run.error if result.run else result
    vms = vm_view(host)
    assert vms["build-box"][0] is True, vms
    assert vms["win11-cad"][0] is False  # its GPU went to the host: it stays stopped for the cloud to move


def test_rollback_leaves_the_vms_as_they_were(tmp_path: Path) -> None:
    host = workstation_with_a_bystander(tmp_path)
    before = vm_view(host)
    result = engine.apply(host, SwitchRequest(Mode.ACCEL, vm_policy=VmPolicy.ALL))
    assert result.ok and result.run is not None
    undone = engine.undo_finished(host, result.run.plan_id)
    assert undone.state is RunState.ROLLED_BACK, undone.error
    assert vm_view(host) == before


def test_the_cli_shows_it_and_can_turn_it_off(tmp_path: Path) -> None:
    host = workstation_with_a_bystander(tmp_path)
    shown = run_cli("plan", "--mode", "accel", "--vm-policy", "all", "--root", str(host.root))
    assert shown.returncode == 0, shown.stderr
    assert "VMs started again" in shown.stdout and "VMs left stopped" in shown.stdout
    args = ["--mode", "accel", "--vm-policy", "all", "--no-restart-vms", "--json", "--root", str(host.root)]
    off = run_cli("plan", *args)
    data = json.loads(off.stdout)
    assert data["impact"]["vms_restarted"] == [] and data["request"]["restart_vms"] is False
