"""Catalog, whitelist, groups, events and the audit log through the real API."""

from __future__ import annotations

from gpumode.server.auth import Role

from .builders import host
from .conftest import Api


def test_openapi_is_served(api: Api) -> None:
    spec = api.client.get("/api/v1/openapi.json").json()
    assert "/api/v1/nodes/{name}/report" in spec["paths"]
    assert spec["info"]["title"] == "gpumode"


def test_profiles_and_aliases(api: Api) -> None:
    op = api.token(Role.OPERATOR)
    r = api.call("PUT", "/profiles/l40s-4q", op, json={"vgpu_type": "NVIDIA L40S-4Q", "count_per_gpu": 12})
    assert r.status_code == 200
    assert api.get("/profiles").json() == [
        {"name": "l40s-4q", "vgpu_type": "NVIDIA L40S-4Q", "count_per_gpu": 12, "description": ""}
    ]
    assert (
        api.call("PUT", "/profiles/bad", op, json={"vgpu_type": "x", "count_per_gpu": 0}).status_code == 422
    )
    assert (
        api.call("PUT", "/profiles/bad name", op, json={"vgpu_type": "x", "count_per_gpu": 1}).status_code
        == 422
    )
    r = api.call("PUT", "/aliases/h100", op, json={"vendor_id": "0x10DE", "product_id": 0x2330})
    assert r.status_code == 200 and r.json() == {
        "name": "h100",
        "vendor_id": "10de",
        "product_id": "2330",
        "description": "",
    }
    assert api.call("PUT", "/aliases/x", op, json={"vendor_id": "10dex", "product_id": 1}).status_code == 422
    assert api.call("DELETE", "/aliases/h100", op).status_code == 204
    assert api.call("DELETE", "/aliases/h100", op).status_code == 404
    assert api.get("/aliases").json() == []


def test_whitelist_levels(api: Api) -> None:
    assert api.get("/modes").json() == {
        "platform": ["accel", "vgpu", "passthrough"],
        "groups": {},
        "models": {},
    }
    api.join("n1")
    assert api.call("PUT", "/groups/inference", api.admin, json={"nodes": ["n1"]}).status_code == 200
    doc = {
        "platform": ["passthrough", "accel", "vgpu"],
        "groups": {"inference": ["accel"]},
        "models": {"10DE:1EB8": ["accel", "passthrough"]},
    }
    r = api.call("PUT", "/modes", api.admin, json=doc)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "platform": ["accel", "vgpu", "passthrough"],
        "groups": {"inference": ["accel"]},
        "models": {"10de:1eb8": ["accel", "passthrough"]},
    }
    assert api.get("/modes").json() == r.json()
    for bad in (
        {"platform": ["none"]},
        {"groups": {"nope": ["accel"]}},
        {"models": {"2330": ["accel"]}},
        {"platform": ["turbo"]},
    ):
        assert api.call("PUT", "/modes", api.admin, json=bad).status_code == 422, bad
    assert api.get("/modes").json() == r.json()  # nothing changed by the refusals
    assert api.call("DELETE", "/groups/inference", api.admin).status_code == 204
    assert api.get("/modes").json()["groups"] == {}


def test_groups_membership(api: Api) -> None:
    for name in ("n1", "n2", "n3"):
        api.join(name, gpus=1)
    api.call("PUT", "/groups/a", api.admin, json={"nodes": ["n1", "n2"]})
    api.call("PUT", "/groups/a", api.admin, json={"nodes": ["n2", "n3"]})
    assert api.get("/groups").json() == [{"name": "a", "nodes": ["n2", "n3"]}]
    assert [n["name"] for n in api.get("/nodes", params={"group": "a"}).json()] == ["n2", "n3"]
    r = api.call("PUT", "/groups/a", api.admin, json={"nodes": ["n1", "ghost"]})
    assert r.status_code == 422 and "ghost" in r.text
    assert api.get("/groups").json() == [{"name": "a", "nodes": ["n2", "n3"]}]


def test_events_filters(api: Api) -> None:
    t1 = api.join("n1", gpus=2)
    api.join("n2", gpus=1)
    api.report("n1", t1, host("n1", gpus=1).to_dict())
    assert {e["node"] for e in api.events(node="n2")} == {"n2"}
    assert [e["kind"] for e in api.events(node="n1", kind="hardware.removed")] == ["hardware.removed"]
    assert {e["kind"] for e in api.events(kind="card.")} == {"card.added", "card.removed"}
    assert all(e["severity"] == "warning" for e in api.events(severity="warning"))
    first_page = api.events(limit=2)
    rest = api.events(before_id=first_page[-1]["id"])
    assert len(first_page) == 2 and rest and rest[0]["id"] < first_page[-1]["id"]


def test_card_patch_rules(api: Api) -> None:
    api.join("n1", gpus=1)
    card = api.cards()[0]
    assert api.call("PATCH", f"/cards/{card['id']}", api.admin, json={"status": "in_use"}).status_code == 422
    assert api.call("PATCH", f"/cards/{card['id']}", api.admin, json={"status": "lost"}).status_code == 422
    assert api.call("PATCH", "/cards/999999", api.admin, json={"status": "free"}).status_code == 404
    r = api.call("PATCH", f"/cards/{card['id']}", api.admin, json={"status": "reserved", "holder": "vm-1"})
    assert r.json()["status"] == "reserved" and r.json()["holder"] == "vm-1"
    r = api.call("PATCH", f"/cards/{card['id']}", api.admin, json={"status": "free"})
    assert r.json()["status"] == "free" and r.json()["holder"] is None
    assert [c["id"] for c in api.cards(status="free", kind="accel")] == [card["id"]]


def test_every_mutating_call_is_audited(api: Api) -> None:
    viewer = api.token(Role.VIEWER, name="v")
    token = api.join("n1", gpus=2)
    api.report("n1", token, host("n1", gpus=1).to_dict())  # a change: audited
    api.report("n1", token, host("n1", gpus=1).to_dict())  # unchanged: nothing written, not audited
    api.call("PUT", "/profiles/p", api.admin, json={"vgpu_type": "t", "count_per_gpu": 1})
    api.call("PUT", "/profiles/p", viewer, json={"vgpu_type": "t", "count_per_gpu": 1})  # 403
    api.call("PUT", "/profiles/p", None, json={"vgpu_type": "t", "count_per_gpu": 1})  # 401
    api.call("DELETE", "/profiles/nope", api.admin)  # 404
    api.call("PUT", "/modes", api.admin, json={"platform": ["x"]})  # 422
    entries = list(reversed(api.get("/audit").json()))
    got = [(e["actor"], e["action"], e["status_code"]) for e in entries]
    assert got == [
        ("root", "POST /api/v1/tokens", 201),
        ("root", "POST /api/v1/join-tokens", 201),
        ("join:test", "POST /api/v1/agents/join", 201),
        ("node:n1", "POST /api/v1/nodes/{name}/report", 200),
        ("root", "PUT /api/v1/profiles/{name}", 200),
        ("v", "PUT /api/v1/profiles/{name}", 403),
        ("anonymous", "PUT /api/v1/profiles/{name}", 401),
        ("root", "DELETE /api/v1/profiles/{name}", 404),
        ("root", "PUT /api/v1/modes", 422),
    ]
    assert entries[3]["target"] == "node:n1" and entries[3]["role"] == "node"
    assert all(e["created_at"].endswith(("+00:00", "Z")) for e in entries)
