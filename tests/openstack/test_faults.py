"""Placement failing mid-switch: gpumode waits with a clear message, or puts back what it wrote."""

from __future__ import annotations

import pytest

from gpumode.cloud.openstack.http import OpenStackError
from gpumode.domain import Mode
from gpumode.host.discover import discover

from .conftest import Stack
from .services import Faults


def marks(stack: Stack) -> dict[str, tuple[set[str], set[str]]]:
    p = stack.placement
    return {n: (p.traits(rp["uuid"]), p.aggregates(rp["uuid"])) for n, rp in p.providers().items()}


def test_trait_write_failing_midway_puts_back_every_mark(stack: Stack, faults: Faults) -> None:
    stack.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    stack.platform.set_up_cards(discover(stack.host))
    before = marks(stack)
    aggregates_before = {a["name"]: list(a["hosts"]) for a in stack.nova.aggregates.values()}
    stack.switch(Mode.PASSTHROUGH)

    puts: list[str] = []

    def third_trait_put_fails(method: str, path: str) -> bool:
        if method == "PUT" and path.endswith("/traits") and path.startswith("/resource_providers/"):
            puts.append(path)
            return len(puts) == 3
        return False

    faults.fail = third_trait_put_fails
    with pytest.raises(OpenStackError, match=r"marking GPU modes in Placement failed.*put back"):
        stack.platform.set_up_cards(discover(stack.host))
    faults.fail = None
    # Inventory is nova-compute's own report; gpumode's marks are exactly as before, on every provider
    after = marks(stack)
    assert {n: after[n] for n in before if n in after} == {n: before[n] for n in before if n in after}
    assert all(m == (set(), set()) for n, m in after.items() if n not in before)
    assert {a["name"]: a["hosts"] for a in stack.nova.aggregates.values()} == aggregates_before

    stack.platform.set_up_cards(discover(stack.host))  # Placement is back: the retry completes
    assert stack.placement.traits(stack.provider(stack.name)["uuid"]) == {"CUSTOM_GPUMODE_PASSTHROUGH"}


def test_placement_down_while_waiting_times_out_clearly_and_writes_nothing(
    stack: Stack, faults: Faults
) -> None:
    stack.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    stack.platform.set_up_cards(discover(stack.host))
    before = marks(stack)
    stack.switch(Mode.ACCEL)
    stack.reporter.restart = lambda: None  # type: ignore[method-assign]  # nova-compute cannot report either
    faults.fail = lambda method, path: True
    with pytest.raises(OpenStackError) as err:
        stack.platform.set_up_cards(discover(stack.host))
    message = str(err.value)
    assert "timed out after 5s waiting for Placement to show" in message
    assert "unreachable" in message or "HTTP 503" in message
    faults.fail = None
    assert marks(stack) == before


def test_inventory_never_appearing_times_out_naming_the_provider(stack: Stack) -> None:
    stack.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    stack.reporter.restart = lambda: None  # type: ignore[method-assign]
    stack.placement.call("POST", "/resource_providers", {"name": stack.name})
    with pytest.raises(OpenStackError, match=r"_pci_0000_18_00_0 absent"):
        stack.platform.set_up_cards(discover(stack.host))
    root = stack.provider(stack.name)
    assert stack.placement.traits(root["uuid"]) == set()


def test_failed_restart_stops_before_placement(stack: Stack, faults: Faults) -> None:
    stack.switch(Mode.PASSTHROUGH)
    stack.channel.broken_restart = True
    faults.seen.clear()
    with pytest.raises(OpenStackError, match=r"restarting nova-compute on .* failed \(exit 1\): Job for"):
        stack.platform.set_up_cards(discover(stack.host))
    assert faults.seen == []  # not one request to Placement
    assert stack.placement.providers() == {}
