"""Switches with REAL nova-compute (nova's libvirt driver over fakelibvirt mirrored from the emulated host,
restarted by each switch's card set-up) reporting to the real Placement: afterwards Placement is exactly what
the target says — no provider offering a mode its GPU left, marks and aggregates right, no allocation lost.

Each nova-compute start is a subprocess of the nova venv (about 10 s); see ``realnova.py``."""

from __future__ import annotations

import json
import uuid

import pytest

from gpumode.cloud.openstack.platform import StaleProviderHeld
from gpumode.domain import Mode, VmPolicy
from gpumode.host.discover import discover

from .conftest import Stack
from .realnova import NOVA_CONF

pytestmark = pytest.mark.nova

GPUS = ["0000:18:00.0", "0000:3b:00.0", "0000:99:00.0", "0000:b0:00.0"]
NIC = "0000:02:00.0"  # the emulated host's igb NIC (8086:1533)
VGPU, PT, ACCEL = "CUSTOM_GPUMODE_VGPU", "CUSTOM_GPUMODE_PASSTHROUGH", "CUSTOM_GPUMODE_ACCEL"


def vgpu_rp(stack: Stack, gpu: str) -> str:
    return f"{stack.name}_pci_" + gpu.replace(":", "_").replace(".", "_")


def pci_rp(stack: Stack, address: str) -> str:
    return f"{stack.name}_{address.upper()}"  # as nova names it: 't4-edge-02_0000:3B:00.0'


def ours(traits: set[str]) -> set[str]:
    return {t for t in traits if t.startswith("CUSTOM_GPUMODE_")}


def aggregate(stack: Stack, mode: str) -> dict[str, object]:
    return next(a for a in stack.nova.aggregates.values() if a["name"] == f"gpumode-{mode}")


def gpu_inventory(stack: Stack) -> dict[str, dict[str, int]]:
    """Every child provider of the host → its inventory (what the scheduler can hand out)."""
    p = stack.placement
    root = stack.provider(stack.name)["uuid"]
    return {
        n: p.inventories(rp["uuid"])
        for n, rp in p.providers().items()
        if rp["root_provider_uuid"] == root and rp["uuid"] != root
    }


def test_vgpu_then_passthrough_then_accel(real_stack: Stack) -> None:
    s, p = real_stack, real_stack.placement
    s.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    s.platform.set_up_cards(discover(s.host))
    assert s.real.restarts == 1
    # nova's own report: one provider per mdev parent, VGPU = existing mdevs + available instances (16 / 2 GB)
    assert gpu_inventory(s) == {vgpu_rp(s, g): {"VGPU": 8} for g in GPUS}
    root = s.provider(s.name)
    assert ours(p.traits(root["uuid"])) == {VGPU}
    vgpu_agg = aggregate(s, "vgpu")
    for gpu in GPUS:
        rp = s.provider(vgpu_rp(s, gpu))["uuid"]
        assert ours(p.traits(rp)) == {VGPU} and p.aggregates(rp) == {vgpu_agg["uuid"]}
        assert "OWNER_NOVA" in p.traits(rp)  # nova's traits are left alone

    # A VM holds a vGPU of the first GPU; the other three go to passthrough around it.
    held = s.provider(vgpu_rp(s, GPUS[0]))["uuid"]
    consumer = str(uuid.uuid4())
    p.allocate(consumer, held, {"VGPU": 1})
    s.nova.add_server("vdi-1", s.name, {"resources:VGPU": "1"})
    hold = s.platform.before_switch(s.name, job="job 7", policy=VmPolicy.GPU)
    s.switch(Mode.PASSTHROUGH, gpus=GPUS[1:])
    note = s.platform.set_up_cards(discover(s.host), alias="t4")
    assert s.platform.after_switch(hold, succeeded=True) == []
    # real nova left the three VGPU providers with their inventory; gpumode deleted them before marking
    assert f"deleted stale GPU provider(s) {', '.join(vgpu_rp(s, g) for g in GPUS[1:])}" in note
    assert gpu_inventory(s) == {
        vgpu_rp(s, GPUS[0]): {"VGPU": 8},
        **{pci_rp(s, g): {"CUSTOM_PCI_10DE_1EB8": 1} for g in GPUS[1:]},
    }
    assert ours(p.traits(root["uuid"])) == {VGPU, PT}
    pt_agg = aggregate(s, "passthrough")
    assert p.aggregates(root["uuid"]) == {vgpu_agg["uuid"], pt_agg["uuid"]}
    assert pt_agg["hosts"] == [s.name] and vgpu_agg["hosts"] == [s.name]
    for gpu in GPUS[1:]:
        rp = s.provider(pci_rp(s, gpu))["uuid"]
        assert ours(p.traits(rp)) == {PT} and p.aggregates(rp) == {pt_agg["uuid"]}
    assert ours(p.traits(held)) == {VGPU}
    allocations = p.allocations(consumer)
    assert set(allocations) == {held} and allocations[held]["resources"] == {"VGPU": 1}

    # The VM is shelved (nova frees its allocation); the whole host goes to accel.
    p.call("DELETE", f"/allocations/{consumer}")
    s.switch(Mode.ACCEL)
    s.platform.set_up_cards(discover(s.host))
    assert s.real.restarts == 3
    assert "report_in_placement = True" in s.host.path(s.config.nova_dropin).read_text()
    assert gpu_inventory(s) == {}
    assert ours(p.traits(root["uuid"])) == {ACCEL}
    assert p.aggregates(root["uuid"]) == {aggregate(s, "accel")["uuid"]}
    assert aggregate(s, "vgpu")["hosts"] == [] and aggregate(s, "passthrough")["hosts"] == []
    assert s.platform.sync_hardware(discover(s.host)) == []


def test_a_gpu_whose_vgpu_is_held_cannot_leave_vgpu(real_stack: Stack) -> None:
    """Refused, and nothing deleted: Placement would still offer the held GPU's vGPUs on a passthrough GPU."""
    s, p = real_stack, real_stack.placement
    s.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    s.platform.set_up_cards(discover(s.host))
    held = s.provider(vgpu_rp(s, GPUS[0]))["uuid"]
    consumer = str(uuid.uuid4())
    p.allocate(consumer, held, {"VGPU": 1})
    s.switch(Mode.PASSTHROUGH)
    with pytest.raises(StaleProviderHeld, match=rf"GPU {GPUS[0]} left vgpu but consumer\(s\) {consumer}"):
        s.platform.set_up_cards(discover(s.host))
    assert set(gpu_inventory(s)) >= {vgpu_rp(s, g) for g in GPUS}  # nothing deleted
    assert p.allocations(consumer)[held]["resources"] == {"VGPU": 1}
    # the hardware sync keeps the held provider (and says so), deletes the three nobody holds
    drift = {(d.provider, d.problem, d.fixed) for d in s.platform.sync_hardware(discover(s.host))}
    kept = [d for d in drift if d[0] == vgpu_rp(s, GPUS[0]) and not d[2]]
    assert len(kept) == 1 and "still hold allocations; kept" in kept[0][1], drift
    deleted = "stale GPU provider with no allocations; deleted"
    assert {(vgpu_rp(s, g), deleted, True) for g in GPUS[1:]} <= drift
    assert set(gpu_inventory(s)) == {vgpu_rp(s, GPUS[0])} | {pci_rp(s, g) for g in GPUS}


def test_an_operators_pci_device_in_placement_is_not_taken_for_a_gpu(real_stack: Stack) -> None:
    """The operator's nova.conf passes the NIC through and reports it in Placement; gpumode's drop-in adds its
    GPUs (``[pci] device_spec`` adds up across files). Neither card set-up nor the hardware sync touch it."""
    s, p = real_stack, real_stack.placement
    spec = {"vendor_id": "8086", "product_id": "1533", "address": NIC}
    conf = s.host.path(NOVA_CONF)
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(f"[pci]\ndevice_spec = {json.dumps(spec)}\nreport_in_placement = True\n")
    s.switch(Mode.PASSTHROUGH, gpus=GPUS[:1])
    s.platform.set_up_cards(discover(s.host))
    assert gpu_inventory(s) == {
        pci_rp(s, NIC): {"CUSTOM_PCI_8086_1533": 1},
        pci_rp(s, GPUS[0]): {"CUSTOM_PCI_10DE_1EB8": 1},
    }
    assert ours(p.traits(s.provider(pci_rp(s, NIC))["uuid"])) == set()
    assert s.platform.sync_hardware(discover(s.host)) == []
    assert pci_rp(s, NIC) in p.providers()
