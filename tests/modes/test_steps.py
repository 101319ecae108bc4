"""Single steps on emulated hosts: check / apply / undo each do what docs/plan-steps.md says, and apply is a
no-op when the step is already done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import make_host, view

from gpumode.domain import Impact, Mode, Plan, Step, SwitchRequest
from gpumode.host import bind, driverops
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.host.vms import open_hypervisor
from gpumode.modes.steps import StepContext, StepError, default_registry


def context(host: Host, step: Step, record: dict[str, Any] | None = None) -> StepContext:
    plan = Plan("h", SwitchRequest(Mode.ACCEL), [step], Impact())
    hv = open_hypervisor(host)
    return StepContext(host, step, record if record is not None else {}, plan, lambda: None, lambda: hv)


def run_step(host: Host, action: str, target: str, **params: Any) -> tuple[StepContext, Any]:
    impl = default_registry().get(action)
    ctx = context(host, Step(id=f"01-{action}-{target}", action=action, target=target, params=params))
    return ctx, impl


def test_every_documented_host_action_has_an_implementation() -> None:
    doc = (Path(__file__).parents[2] / "docs/plan-steps.md").read_text()
    import re

    documented = set(re.findall(r"^### `([a-z_.]+)`", doc, re.M))
    documented |= {a for pair in re.findall(r"^### `([a-z_.]+)` / `([a-z_.]+)`", doc, re.M) for a in pair}
    host_actions = {a for a in documented if not a.startswith("cloud.")}
    assert host_actions <= set(default_registry().actions())


def test_unknown_action_is_a_clear_error() -> None:
    with pytest.raises(StepError, match=r"no step implementation for action 'gpu\.explode'"):
        default_registry().get("gpu.explode")


def test_bind_vfio_then_undo_restores_the_group(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    gpu = discover(host).gpus[0]
    assert gpu.driver is None  # t4-mdev boots with no driver loaded
    before = view(host)
    ctx, impl = run_step(host, "bind.vfio", gpu.address, functions=[], persist=True)
    assert not impl.check(host, ctx)
    impl.apply(host, ctx)
    assert impl.check(host, ctx)
    assert set(ctx.record["before"]) == set(bind.vfio_members(host, gpu.address))
    assert all(bind.current_driver(host, m) == "vfio-pci" for m in bind.vfio_members(host, gpu.address))
    impl.apply(host, ctx)  # done: a no-op
    impl.undo(host, ctx, ctx.record)
    after = view(host)
    # bind_to_vfio loads vfio-pci when missing; unloading it is module.load's undo, not this step's
    del after["modules"], before["modules"]
    assert after == before
    assert not any(host.path("etc/driverctl.d").glob("*")) if host.path("etc/driverctl.d").exists() else True


def test_module_steps_record_only_what_they_changed(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    loaded = driverops.module_loaded(host, "vfio_pci")
    ctx, impl = run_step(host, "module.load", "vfio_pci")
    impl.apply(host, ctx)
    assert driverops.module_loaded(host, "vfio_pci")
    impl.undo(host, ctx, ctx.record)
    assert driverops.module_loaded(host, "vfio_pci") is loaded


def test_remember_happens_before_the_host_changes(tmp_path: Path) -> None:
    """If the operation itself fails, the journal already holds the undo record."""
    host = make_host(tmp_path / "h", "l40s-sriov")
    gpu = discover(host).gpus[0]
    saved: list[dict[str, Any]] = []
    step = Step(id="01-service.start", action="service.start", target="no-such-unit-xyz.service")
    hv = open_hypervisor(host)
    ctx = StepContext(
        host,
        step,
        {},
        Plan("h", SwitchRequest(Mode.ACCEL), [step], Impact()),
        lambda: saved.append({}),
        lambda: hv,
    )
    impl = default_registry().get("service.start")
    with pytest.raises(Exception):  # noqa: B017 - whatever systemctl says, the record must be saved first
        impl.apply(host, ctx)
    assert saved and ctx.record == {"started": True}
    assert gpu.address  # the host is real


def test_vm_steps_detach_and_reattach(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "a16-vdi")
    hv = open_hypervisor(host)
    vms = [vm for vm in hv.list_vms() if vm.devices]
    if not vms:
        pytest.skip("a16-vdi has no VM holding a device")
    vm = vms[0]
    device = vm.devices[0]
    ctx, shutdown = run_step(host, "vm.shutdown", vm.name, timeout_s=1.0)
    shutdown.apply(host, ctx)
    assert shutdown.check(host, ctx)
    dctx, detach = run_step(host, "vm.detach_device", vm.name, kind=device.kind, id=device.id)
    detach.apply(host, dctx)
    assert detach.check(host, dctx)
    assert dctx.record["detached"] == {"kind": device.kind, "id": device.id}
    detach.undo(host, dctx, dctx.record)
    shutdown.undo(host, ctx, ctx.record)
    after = {v.name: v for v in open_hypervisor(host).list_vms()}[vm.name]
    assert device in after.devices and after.running is vm.running
