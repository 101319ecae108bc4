"""Nova around a switch, over HTTP against the fake compute API: service disable/enable and the VM policy."""

from __future__ import annotations

import pytest

from gpumode.cloud.openstack.http import OpenStackError
from gpumode.domain import VmPolicy

from .conftest import Stack

VGPU_FLAVOR = {"resources:VGPU": "1"}
PT_FLAVOR = {"pci_passthrough:alias": "t4:1"}


def service(stack: Stack) -> dict[str, object]:
    return next(iter(stack.nova.services.values()))


def test_policy_all_stops_every_instance_and_a_failed_switch_starts_them_again(stack: Stack) -> None:
    a = stack.nova.add_server("a", stack.name, VGPU_FLAVOR)
    b = stack.nova.add_server("b", stack.name)
    elsewhere = stack.nova.add_server("c", "other-host", VGPU_FLAVOR)
    hold = stack.platform.before_switch(stack.name, job="job 3", policy=VmPolicy.ALL)
    assert (a.status, b.status, elsewhere.status) == ("SHUTOFF", "SHUTOFF", "ACTIVE")
    assert [m["name"] for m in hold["moved"]] == ["a", "b"]
    assert stack.platform.after_switch(hold, succeeded=False) == []
    assert (a.status, b.status) == ("ACTIVE", "ACTIVE") and service(stack)["status"] == "enabled"


def test_shelve_and_live_migrate_as_configured(
    host: object, placement: object, nova: tuple[object, object]
) -> None:
    fake, served = nova
    stack = Stack(host, placement, fake, served.url, vm_action="shelve", live_migrate_vgpu=True)  # type: ignore[arg-type]
    fake.add_service(stack.name)  # type: ignore[attr-defined]
    vgpu = fake.add_server("vdi", stack.name, VGPU_FLAVOR)  # type: ignore[attr-defined]
    pt = fake.add_server("train", stack.name, PT_FLAVOR)  # type: ignore[attr-defined]
    stack.platform.before_switch(stack.name, job="job 4", policy=VmPolicy.GPU)
    assert (vgpu.status, vgpu.host) == ("ACTIVE", "compute-spare")
    assert pt.status == "SHELVED_OFFLOADED"
    migrate = [b for m, p, b in fake.requests if p.endswith("/action") and "os-migrateLive" in b]  # type: ignore[attr-defined]
    assert migrate == [{"os-migrateLive": {"host": None, "block_migration": "auto"}}]


def test_refuse_policy_changes_nothing(stack: Stack) -> None:
    stack.nova.add_server("vdi", stack.name, VGPU_FLAVOR)
    with pytest.raises(OpenStackError, match=r"vm_policy refuse: instances with GPUs are running on .*: vdi"):
        stack.platform.before_switch(stack.name, job="job 5", policy=VmPolicy.REFUSE)
    assert service(stack)["status"] == "enabled"


def test_an_instance_that_cannot_stop_undoes_the_rest(stack: Stack) -> None:
    a = stack.nova.add_server("a", stack.name, VGPU_FLAVOR)
    b = stack.nova.add_server("b", stack.name, VGPU_FLAVOR)
    b.status = "MIGRATING"  # os-stop answers 409 in this state
    with pytest.raises(OpenStackError, match=r"nova POST /servers/.*/action: HTTP 409: Cannot 'os-stop'"):
        stack.platform.before_switch(stack.name, job="job 6", policy=VmPolicy.GPU)
    assert a.status == "ACTIVE" and service(stack)["status"] == "enabled"


def test_service_disabled_by_an_operator_stays_disabled(stack: Stack) -> None:
    svc = service(stack)
    svc["status"], svc["disabled_reason"] = "disabled", "hardware maintenance"
    hold = stack.platform.before_switch(stack.name, job="job 8", policy=VmPolicy.GPU)
    assert hold["disabled_by_us"] is False
    assert stack.platform.after_switch(hold, succeeded=True) == []
    assert (svc["status"], svc["disabled_reason"]) == ("disabled", "hardware maintenance")


def test_unknown_host_is_a_clear_error(stack: Stack) -> None:
    with pytest.raises(OpenStackError, match="Nova has no nova-compute service on host nowhere"):
        stack.platform.before_switch("nowhere", job="job 9", policy=VmPolicy.GPU)
