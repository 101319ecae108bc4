"""A whole switch vGPU → passthrough → accel against the real Placement: drop-in, restart, inventory, traits,
aggregates, Nova service and instances — and an allocation that must survive all of it."""

from __future__ import annotations

import uuid

from gpumode.cloud.openstack.novaconf import HEADER
from gpumode.domain import Mode, VmPolicy
from gpumode.host.discover import discover

from .conftest import Stack

GPUS = ["0000:18:00.0", "0000:3b:00.0", "0000:99:00.0", "0000:b0:00.0"]
VGPU, PT, ACCEL = "CUSTOM_GPUMODE_VGPU", "CUSTOM_GPUMODE_PASSTHROUGH", "CUSTOM_GPUMODE_ACCEL"


def vgpu_provider(stack: Stack, gpu: str) -> str:
    return f"{stack.name}_pci_" + gpu.replace(":", "_").replace(".", "_")


def nova_aggregate(stack: Stack, mode: str) -> dict[str, object]:
    return next(a for a in stack.nova.aggregates.values() if a["name"] == f"gpumode-{mode}")


def test_vgpu_then_passthrough_then_accel(stack: Stack) -> None:
    p = stack.placement
    stack.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    note = stack.platform.set_up_cards(discover(stack.host))
    assert "restarted" in note and stack.reporter.restarts == 1

    dropin = stack.host.path(stack.config.nova_dropin).read_text()
    assert dropin.startswith(HEADER) and "[devices]\nenabled_mdev_types = nvidia-" in dropin
    assert f"device_addresses = {','.join(GPUS)}" in dropin and "[pci]" not in dropin
    root = stack.provider(stack.name)
    assert p.traits(root["uuid"]) == {VGPU}
    vgpu_agg = nova_aggregate(stack, "vgpu")
    assert p.aggregates(root["uuid"]) == {vgpu_agg["uuid"]} and vgpu_agg["hosts"] == [stack.name]
    for gpu in GPUS:
        rp = stack.provider(vgpu_provider(stack, gpu))
        assert p.inventories(rp["uuid"])["VGPU"] >= 2
        assert p.traits(rp["uuid"]) == {VGPU}
        assert p.aggregates(rp["uuid"]) == {vgpu_agg["uuid"]}

    # A VM holds a vGPU on the first GPU: Placement has its allocation, Nova its instance.
    held = stack.provider(vgpu_provider(stack, GPUS[0]))
    consumer = str(uuid.uuid4())
    p.allocate(consumer, held["uuid"], {"VGPU": 1})
    vm = stack.nova.add_server("vdi-1", stack.name, {"resources:VGPU": "1"})
    bystander = stack.nova.add_server("web-1", stack.name, {})

    hold = stack.platform.before_switch(stack.name, job="job 7", policy=VmPolicy.GPU)
    service = next(iter(stack.nova.services.values()))
    assert service["status"] == "disabled" and service["disabled_reason"] == "gpumode job 7: GPU mode switch"
    assert vm.status == "SHUTOFF" and bystander.status == "ACTIVE"

    stack.switch(Mode.PASSTHROUGH)
    stack.platform.set_up_cards(discover(stack.host), alias="t4")
    assert stack.platform.after_switch(hold, succeeded=True) == []
    assert service["status"] == "enabled" and vm.status == "SHUTOFF"

    dropin = stack.host.path(stack.config.nova_dropin).read_text()
    assert (
        '"name":"t4","vendor_id":"10de","product_id":"1eb8"' in dropin and "enabled_mdev_types" not in dropin
    )
    assert p.traits(root["uuid"]) == {PT}
    pt_agg = nova_aggregate(stack, "passthrough")
    assert p.aggregates(root["uuid"]) == {pt_agg["uuid"]}
    assert nova_aggregate(stack, "vgpu")["hosts"] == []
    for gpu in GPUS:
        rp = stack.provider(f"{stack.name}_{gpu}")
        assert p.inventories(rp["uuid"]) == {"CUSTOM_PCI_10DE_1EB8": 1}
        assert p.traits(rp["uuid"]) == {PT}
    # nova could not drop the held vGPU provider; gpumode unmarked it and kept it, allocation intact
    assert stack.reporter.kept == [vgpu_provider(stack, GPUS[0])]
    assert p.traits(held["uuid"]) == set() and p.aggregates(held["uuid"]) == set()
    assert p.allocations(consumer)[held["uuid"]]["resources"] == {"VGPU": 1}
    assert all(vgpu_provider(stack, g) not in stack.placement.providers() for g in GPUS[1:])

    stack.switch(Mode.ACCEL)
    stack.platform.set_up_cards(discover(stack.host))
    assert stack.host.path(stack.config.nova_dropin).read_text() == HEADER
    assert p.traits(root["uuid"]) == {ACCEL}
    assert p.aggregates(root["uuid"]) == {nova_aggregate(stack, "accel")["uuid"]}
    assert set(stack.gpu_providers()) == {vgpu_provider(stack, GPUS[0])}
    assert p.allocations(consumer)[held["uuid"]]["resources"] == {"VGPU": 1}

    # Hardware sync: the held provider is drift it must not fix; nothing else is off.
    drift = stack.platform.sync_hardware(discover(stack.host))
    assert [(d.provider, d.fixed) for d in drift] == [(vgpu_provider(stack, GPUS[0]), False)]
    assert "still hold allocations; kept" in drift[0].problem and consumer in drift[0].problem
    assert vgpu_provider(stack, GPUS[0]) in p.providers()


def test_sync_deletes_unheld_stale_provider_and_restores_marks(stack: Stack) -> None:
    p = stack.placement
    stack.switch(Mode.PASSTHROUGH)
    stack.platform.set_up_cards(discover(stack.host))
    root = stack.provider(stack.name)
    stale = p.call(
        "POST",
        "/resource_providers",
        {"name": f"{stack.name}_pci_0000_18_00_0", "parent_provider_uuid": root["uuid"]},
    )
    generation = p.call("GET", f"/resource_providers/{root['uuid']}")["generation"]
    body = {"traits": [], "resource_provider_generation": generation}
    p.call("PUT", f"/resource_providers/{root['uuid']}/traits", body)  # someone wiped gpumode's marks

    drift = stack.platform.sync_hardware(discover(stack.host))
    assert {(d.provider, d.fixed) for d in drift} == {(stale["name"], True), (stack.name, True)}
    assert stale["name"] not in p.providers()
    assert p.traits(root["uuid"]) == {PT}
    assert stack.platform.sync_hardware(discover(stack.host)) == []
