"""Hardware sync: unchanged reports write nothing; changes become events and card changes; held cards stay."""

from __future__ import annotations

from typing import Any

from gpumode.domain import Mode

from .builders import host, refingerprint, with_vendor_vgpu
from .conftest import Api


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    return sorted(e["kind"] for e in events)


def test_join_registers_node_and_accel_cards(api: Api) -> None:
    api.join("n1", gpus=2)
    cards = api.cards(node="n1")
    assert [(c["kind"], c["device"], c["status"]) for c in cards] == [
        ("accel", "0000:1b:00.0", "free"),
        ("accel", "0000:1c:00.0", "free"),
    ]
    assert _kinds(api.events(node="n1")) == ["card.added", "card.added", "node.joined"]
    node = api.get("/nodes/n1").json()
    assert node["mode"] == "accel" and node["gpu_count"] == 2
    assert [g["address"] for g in node["gpus"]] == ["0000:1b:00.0", "0000:1c:00.0"]
    assert node["gpus"][0]["device"] == "2330" and len(node["cards"]) == 2


def test_unchanged_report_writes_nothing(api: Api) -> None:
    token = api.join("n1")
    snap = host("n1").to_dict()
    before_events, before_audit = len(api.events()), len(api.get("/audit").json())
    api.writes.writes.clear()
    for _ in range(3):
        r = api.report("n1", token, snap)
        assert r.status_code == 200, r.text
        assert r.json()["changed"] is False
    # The first report of a body not seen before stores its digest, and only that; then not one write.
    assert len(api.writes.digests()) == 1 and api.writes.changes() == []
    api.writes.writes.clear()
    assert api.report("n1", token, snap).json()["changed"] is False
    assert api.writes.writes == []  # not one INSERT/UPDATE/DELETE
    assert len(api.events()) == before_events
    assert len(api.get("/audit").json()) == before_audit
    metrics = api.client.get("/metrics", headers=api.headers(api.admin)).text
    assert 'gpumode_reports_total{result="unchanged"} 4.0' in metrics
    # the report was still seen: liveness comes from memory
    assert api.get("/nodes/n1").json()["last_seen"] is not None


def test_gpu_removed_removes_its_free_card(api: Api) -> None:
    token = api.join("n1", gpus=2)
    smaller = host("n1", gpus=1)
    r = api.report("n1", token, smaller.to_dict())
    assert r.status_code == 200 and r.json()["changed"] is True
    assert r.json()["sync"]["cards_removed"] == 1
    assert [c["device"] for c in api.cards(node="n1")] == ["0000:1b:00.0"]
    removed = api.events(kind="hardware.removed")
    assert len(removed) == 1 and removed[0]["target"] == "0000:1c:00.0"
    assert removed[0]["before"]["id"] == "10de:2330" and removed[0]["after"] is None
    assert len(api.events(kind="card.removed")) == 1
    assert api.get("/nodes/n1").json()["fingerprint"] == smaller.fingerprint


def test_iommu_group_change_replaces_the_card(api: Api) -> None:
    token = api.join("n1", gpus=1)
    old_id = api.cards()[0]["id"]
    moved = host("n1", gpus=1, changes={"0000:1b:00.0": {"iommu_group": 77}})
    moved.gpus[0].iommu_group = 77
    assert api.report("n1", token, refingerprint(moved).to_dict()).status_code == 200
    changed = api.events(kind="hardware.changed")
    assert len(changed) == 1
    assert changed[0]["before"]["iommu_group"] == 10 and changed[0]["after"]["iommu_group"] == 77
    assert "iommu_group" in changed[0]["message"]
    cards = api.cards()
    assert len(cards) == 1 and cards[0]["id"] != old_id and cards[0]["identity"].endswith("group 77")


def test_subsystem_change_is_a_different_device(api: Api) -> None:
    token = api.join("n1", gpus=1)
    swapped = host("n1", gpus=1, changes={"0000:1b:00.0": {"subsystem_device": 0x1234}})
    assert api.report("n1", token, swapped.to_dict()).status_code == 200
    changed = api.events(kind="hardware.changed")
    assert [e["after"]["subsystem"] for e in changed] == ["10de:1234"]
    assert _kinds(api.events(kind="card.")) == ["card.added", "card.added", "card.removed"]


def test_gpu_added_gets_a_card(api: Api) -> None:
    token = api.join("n1", gpus=1)
    r = api.report("n1", token, host("n1", gpus=3).to_dict())
    assert r.json()["sync"]["cards_added"] == 2
    assert [e["target"] for e in api.events(kind="hardware.added")] == ["0000:1d:00.0", "0000:1c:00.0"]
    assert len(api.cards(node="n1")) == 3


def _hold(api: Api, card_id: int, holder: str = "vm-42") -> None:
    r = api.call("PATCH", f"/cards/{card_id}", api.admin, json={"status": "in_use", "holder": holder})
    assert r.status_code == 200, r.text


def test_held_card_is_marked_lost_with_an_alarm_never_dropped(api: Api) -> None:
    token = api.join("n1", gpus=2)
    held = next(c for c in api.cards() if c["device"] == "0000:1c:00.0")
    _hold(api, held["id"])
    assert api.report("n1", token, host("n1", gpus=1).to_dict()).status_code == 200
    card = next(c for c in api.cards() if c["id"] == held["id"])
    assert card["status"] == "lost" and card["holder"] == "vm-42"
    alarms = api.events(kind="alarm.card_lost")
    assert len(alarms) == 1 and alarms[0]["severity"] == "critical" and "vm-42" in alarms[0]["message"]
    # Another change leaves the lost card alone (no second alarm, not removed).
    assert api.report("n1", token, host("n1", gpus=1, mode=Mode.PASSTHROUGH).to_dict()).status_code == 200
    assert any(c["id"] == held["id"] and c["status"] == "lost" for c in api.cards())
    assert len(api.events(kind="alarm.card_lost")) == 1
    # Only an operator releases it; then it is gone.
    r = api.call("PATCH", f"/cards/{held['id']}", api.admin, json={"status": "in_use", "holder": "x"})
    assert r.status_code == 409
    r = api.call("PATCH", f"/cards/{held['id']}", api.admin, json={"status": "free"})
    assert r.status_code == 200, r.text
    assert all(c["id"] != held["id"] for c in api.cards())


def test_lost_card_recovers_when_its_device_returns(api: Api) -> None:
    token = api.join("n1", gpus=2)
    held = api.cards()[1]
    _hold(api, held["id"])
    api.report("n1", token, host("n1", gpus=1).to_dict())
    api.report("n1", token, host("n1", gpus=2).to_dict())
    card = next(c for c in api.cards() if c["id"] == held["id"])
    assert card["status"] == "in_use" and card["holder"] == "vm-42"
    assert len(api.cards()) == 2  # no duplicate for the returning device
    assert len(api.events(kind="card.recovered")) == 1


def test_held_card_on_changed_device_is_lost_and_new_card_registered(api: Api) -> None:
    token = api.join("n1", gpus=1)
    held = api.cards()[0]
    _hold(api, held["id"])
    swapped = host("n1", gpus=1, changes={"0000:1b:00.0": {"subsystem_device": 0x9999}})
    api.report("n1", token, swapped.to_dict())
    statuses = sorted((c["status"], c["identity"][-25:]) for c in api.cards())
    assert [s for s, _ in statuses] == ["free", "lost"]
    # Reporting the same again changes nothing: the lost card does not multiply.
    r = api.report(
        "n1",
        token,
        host(
            "n1",
            gpus=1,
            mode=Mode.ACCEL,
            changes={"0000:1b:00.0": {"subsystem_device": 0x9999, "numa_node": 1}},
        ).to_dict(),
    )
    assert r.status_code == 200 and len(api.cards()) == 2


def test_mode_change_swaps_card_kinds_and_vgpu_cards_per_instance(api: Api) -> None:
    token = api.join("n1", gpus=2)
    vgpu = with_vendor_vgpu(host("n1", gpus=2, mode=Mode.VGPU), "0000:1b:00.0", "0000:1b:00.4")
    r = api.report("n1", token, vgpu.to_dict())
    assert r.status_code == 200, r.text
    cards = api.cards(node="n1")
    assert {c["kind"] for c in cards} == {"vgpu"}
    assert len(cards) == 5  # 2 mdevs per GPU + one vendor-VFIO VF
    vf_card = next(c for c in cards if c["device"] == "0000:1b:00.4")
    assert vf_card["vgpu_type"] == "NVIDIA L40S-1Q" and vf_card["gpu"] == "0000:1b:00.0"  # by name
    # the parent lists no mdev_supported_types here: the type is shown by its id
    assert {c["vgpu_type"] for c in cards if c["device"] != "0000:1b:00.4"} == {"nvidia-222"}
    mode_events = api.events(kind="gpu.mode_changed")
    assert len(mode_events) == 2 and mode_events[0]["after"]["mode"] == "vgpu"
    assert api.get("/nodes", params={"mode": "vgpu"}).json()[0]["name"] == "n1"
    # The VF is configuration, not hardware: no hardware event for it.
    assert api.events(kind="hardware.") == []
    api.report("n1", token, host("n1", gpus=2, mode=Mode.PASSTHROUGH).to_dict())
    assert sorted(c["kind"] for c in api.cards()) == ["passthrough", "passthrough"]
