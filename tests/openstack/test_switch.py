"""The hardware sync against the real Placement, with the stand-in nova-compute (a whole switch vGPU →
passthrough → accel with REAL nova-compute is ``test_real_nova.py``)."""

from __future__ import annotations

from gpumode.domain import Mode
from gpumode.host.discover import discover

from .conftest import Stack

GPUS = ["0000:18:00.0", "0000:3b:00.0", "0000:99:00.0", "0000:b0:00.0"]
VGPU, PT, ACCEL = "CUSTOM_GPUMODE_VGPU", "CUSTOM_GPUMODE_PASSTHROUGH", "CUSTOM_GPUMODE_ACCEL"


def vgpu_provider(stack: Stack, gpu: str) -> str:
    return f"{stack.name}_pci_" + gpu.replace(":", "_").replace(".", "_")


def nova_aggregate(stack: Stack, mode: str) -> dict[str, object]:
    return next(a for a in stack.nova.aggregates.values() if a["name"] == f"gpumode-{mode}")


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
