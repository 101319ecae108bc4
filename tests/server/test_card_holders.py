"""Cards follow the hypervisor (#16): a card whose device a defined VM holds is in use by it (reserved while
it is shut off) on every sync; the hypervisor's hold is let go when the VM lets go; an operator's hold is
not; cards a switch takes away say which job removed them."""

from __future__ import annotations

from typing import Any

from gpumode.domain import Mode

from .builders import host
from .conftest import Api
from .test_jobs import PASSTHROUGH, claim, finish_host, switch

VGPU = "00000000-0000-0000-0000-000000000001"  # the second mdev of the first GPU (builders.host)


def _vm(name: str, running: bool, *devices: tuple[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "uuid": f"uuid-{name}",
        "running": running,
        "devices": [{"kind": kind, "id": device} for kind, device in devices],
    }


def _cards(api: Api, node: str) -> dict[str, tuple[str, str | None]]:
    return {c["device"]: (c["status"], c["holder"]) for c in api.cards(node=node)}


def test_a_vgpu_card_held_by_a_running_vm_is_in_use_and_follows_it(api: Api) -> None:
    snap = host("n1", 1, mode=Mode.VGPU).to_dict()
    r = api.call(
        "POST",
        "/agents/join",
        api.join_token(),
        json={"hostname": "n1", "snapshot": {**snap, "vms": [_vm("vm-01", True, ("mdev", VGPU))]}},
    )
    assert r.status_code == 201, r.text
    token = r.json()["token"]
    assert _cards(api, "n1")[VGPU] == ("in_use", "vm:vm-01")  # at once, on the first sync
    other = next(d for d in _cards(api, "n1") if d != VGPU)
    assert _cards(api, "n1")[other] == ("free", None)

    # shut off: still the VM's, reserved for it
    assert api.report("n1", token, {**snap, "vms": [_vm("vm-01", False, ("mdev", VGPU))]}).status_code == 200
    assert _cards(api, "n1")[VGPU] == ("reserved", "vm:vm-01")
    # the vGPU detached from the VM: free again
    assert api.report("n1", token, {**snap, "vms": [_vm("vm-01", False)]}).status_code == 200
    assert _cards(api, "n1")[VGPU] == ("free", None)
    kinds = [e["kind"] for e in api.events(node="n1") if e["kind"].startswith("card.")]
    assert kinds.count("card.held") == 2 and kinds.count("card.released") == 1
    held = api.events(kind="card.held")
    assert "in use by running VM vm-01" in held[-1]["message"]  # newest first: the first one is last


def test_an_operators_hold_is_not_released_but_a_vm_wins_over_it(api: Api) -> None:
    token = api.join("n1", gpus=2)
    gpu0, gpu1 = "0000:1b:00.0", "0000:1c:00.0"
    ids = {c["device"]: c["id"] for c in api.cards(node="n1")}
    for device in (gpu0, gpu1):
        r = api.call(
            "PATCH", f"/cards/{ids[device]}", api.admin, json={"status": "reserved", "holder": "alice"}
        )
        assert r.status_code == 200, r.text
    vms = [_vm("vm-a", True, ("pci", gpu0))]
    assert api.report("n1", token, {**host("n1", 2).to_dict(), "vms": vms}).status_code == 200
    assert _cards(api, "n1") == {gpu0: ("in_use", "vm:vm-a"), gpu1: ("reserved", "alice")}
    assert "was reserved by alice" in api.events(kind="card.held")[0]["message"]
    assert api.report("n1", token, {**host("n1", 2).to_dict(), "vms": []}).status_code == 200
    assert _cards(api, "n1") == {gpu0: ("free", None), gpu1: ("reserved", "alice")}


def test_cards_a_switch_takes_away_say_which_job_removed_them(api: Api) -> None:
    token = api.join("n1")
    created = switch(api, "n1", PASSTHROUGH)
    assert created.status_code == 201, created.text
    job = claim(api, "n1", token)
    assert finish_host(api, "n1", token, job, Mode.PASSTHROUGH).status_code == 200
    removed = api.events(kind="card.removed")
    assert len(removed) == 2
    assert all(f"removed by switch job {job['id']}" in e["message"] for e in removed), removed
    assert not any("device gone" in e["message"] for e in api.events())
    final = api.get(f"/jobs/{job['id']}").json()
    register = next(s for s in final["steps"] if s["action"] == "cloud.register_cards")
    assert register["note"] == "2 GPU(s) offer 2 passthrough card(s)", register


def test_the_plan_counts_the_vgpus_it_will_register(api: Api) -> None:
    api.join("n1", gpus=2)
    body = {"mode": "vgpu", "vgpu_type": "NVIDIA H100XM-4C", "vgpu_count": 4}
    r = switch(api, "n1", body, dry_run="true")
    assert r.status_code == 200, r.text
    step = next(s for s in r.json()["plan"]["steps"] if s["action"] == "cloud.register_cards")
    assert step["description"] == "register 8 vgpu card(s) on 2 GPU(s)"


def test_a_vms_card_a_switch_takes_away_is_removed_not_lost(api: Api) -> None:
    """The plan's impact named the VM; the card is not an unplanned loss, and the new card is the VM's."""
    gpu0 = "0000:1b:00.0"
    snap = {**host("n1", 2).to_dict(), "vms": [_vm("vm-x", False, ("pci", gpu0))]}
    r = api.call("POST", "/agents/join", api.join_token(), json={"hostname": "n1", "snapshot": snap})
    token = r.json()["token"]
    assert _cards(api, "n1")[gpu0] == ("reserved", "vm:vm-x")
    assert switch(api, "n1", {**PASSTHROUGH, "vm_policy": "all"}).status_code == 201
    job = claim(api, "n1", token)
    assert finish_host(api, "n1", token, job, Mode.PASSTHROUGH).status_code == 200
    assert api.cards(status="lost") == [] and api.events(kind="alarm.card_lost") == []
    removed = [e for e in api.events(kind="card.removed") if e["target"] == gpu0]
    assert len(removed) == 1 and removed[0]["severity"] == "warning"
    assert f"removed by switch job {job['id']}; it was reserved for vm:vm-x" in removed[0]["message"]
    cards = api.cards(node="n1")
    assert {(c["device"], c["kind"], c["status"], c["holder"]) for c in cards if c["device"] == gpu0} == {
        (gpu0, "passthrough", "reserved", "vm:vm-x")
    }
