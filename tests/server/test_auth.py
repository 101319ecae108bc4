"""Authentication and roles: 401 without a valid token, 403 for a role too low or another node's token."""

from __future__ import annotations

import pytest

from gpumode.server.auth import Role

from .builders import host
from .conftest import Api

MUTATING_CALLS = [
    ("POST", "/tokens", {"name": "x", "role": "viewer"}),
    ("POST", "/join-tokens", {"name": "x"}),
    ("PUT", "/modes", {"platform": ["accel"]}),
    ("PUT", "/profiles/p1", {"vgpu_type": "nvidia-222", "count_per_gpu": 2}),
    ("PUT", "/aliases/h100", {"vendor_id": "10de", "product_id": "2330"}),
    ("PUT", "/groups/g1", {"nodes": []}),
]


def test_healthz_needs_no_token(api: Api) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok"}


@pytest.mark.parametrize(
    "path", ["/nodes", "/cards", "/events", "/modes", "/profiles", "/aliases", "/tokens"]
)
def test_no_token_or_bad_token_is_401(api: Api, path: str) -> None:
    assert api.client.get(f"/api/v1{path}").status_code == 401
    assert api.client.get(f"/api/v1{path}", headers={"Authorization": "Bearer gpmu_nope"}).status_code == 401
    assert (
        api.client.get(f"/api/v1{path}", headers={"Authorization": f"Basic {api.admin}"}).status_code == 401
    )


def test_viewer_reads_but_cannot_mutate(api: Api) -> None:
    viewer = api.token(Role.VIEWER)
    assert api.get("/nodes", viewer).status_code == 200
    for method, path, body in MUTATING_CALLS:
        r = api.call(method, path, viewer, json=body)
        assert r.status_code == 403, (method, path, r.text)
    refused = [e for e in api.get("/audit").json() if e["status_code"] == 403]
    assert len(refused) == len(MUTATING_CALLS)
    assert {e["actor"] for e in refused} == {"viewer-user"} and {e["role"] for e in refused} == {"viewer"}


def test_operator_manages_catalog_but_not_tokens_or_whitelist(api: Api) -> None:
    operator = api.token(Role.OPERATOR)
    r = api.call("PUT", "/profiles/p1", operator, json={"vgpu_type": "nvidia-222", "count_per_gpu": 2})
    assert r.status_code == 200
    assert api.call("PUT", "/modes", operator, json={"platform": ["accel"]}).status_code == 403
    assert api.call("POST", "/tokens", operator, json={"name": "y", "role": "admin"}).status_code == 403
    assert api.get("/audit", operator).status_code == 403


def test_node_token_only_for_its_own_node(api: Api) -> None:
    t1 = api.join("n1")
    api.join("n2")
    assert api.report("n1", t1, host("n1").to_dict()).status_code == 200
    r = api.report("n2", t1, host("n2").to_dict())
    assert r.status_code == 403 and "belongs to n1" in r.json()["detail"]
    assert api.get("/nodes/n1", t1).status_code == 200
    assert api.get("/nodes/n2", t1).status_code == 403
    # a node token is no user: it lists nothing and changes nothing else
    assert api.get("/nodes", t1).status_code == 403
    assert api.get("/cards", t1).status_code == 403
    assert api.call("PUT", "/profiles/p", t1, json={"vgpu_type": "a", "count_per_gpu": 1}).status_code == 403


def test_single_use_join_token_and_rejoin_with_proof_revokes_old_node_token(api: Api) -> None:
    join = api.join_token(uses=1)
    body = {"hostname": "n1", "snapshot": host("n1").to_dict()}
    first = api.call("POST", "/agents/join", join, json=body)
    assert first.status_code == 201
    again = api.call("POST", "/agents/join", join, json=body)
    assert again.status_code == 401
    old = first.json()["token"]
    r = api.call("POST", "/agents/join", api.join_token(), json={**body, "node_token": old})
    assert r.status_code == 201, r.text
    new = r.json()["token"]
    assert api.report("n1", old, host("n1").to_dict()).status_code == 401
    assert api.report("n1", new, host("n1").to_dict()).status_code == 200
    rejoined = api.events(kind="node.rejoined")
    assert len(rejoined) == 1 and "current node token" in rejoined[0]["message"]
    assert len(api.cards(node="n1")) == 2  # same hardware: no duplicate cards


def test_rejoin_without_proof_is_refused_and_changes_nothing(api: Api) -> None:
    node_token = api.join("n1")
    other = api.join("n2")
    body = {"hostname": "n1", "snapshot": host("n1", 3).to_dict()}
    join = api.join_token(uses=1)
    for proof in ({}, {"node_token": other}, {"node_token": "gpmn_" + "x" * 43}, {"node_token": api.admin}):
        r = api.call("POST", "/agents/join", join, json={**body, **proof})
        assert r.status_code == 409, (proof, r.text)
        assert r.json()["detail"]["code"] == "node_exists"
        assert "gpumode token replace n1" in r.json()["detail"]["message"]
    # nothing changed: the real agent's token works, the hardware is as it was, the join token is unused
    assert api.report("n1", node_token, host("n1").to_dict()).status_code == 200
    assert len(api.cards(node="n1")) == 2
    assert api.events(kind="node.rejoined") == []
    assert [t["uses_left"] for t in api.get("/join-tokens").json()][-1] == 1
    refused = [e for e in api.get("/audit").json() if e["action"] == "POST /api/v1/agents/join"]
    assert [e["status_code"] for e in refused][:4] == [409] * 4


def test_an_admin_allows_a_replacement_once(api: Api) -> None:
    old = api.join("n1")
    body = {"hostname": "n1", "snapshot": host("n1").to_dict()}
    assert api.call("POST", "/nodes/n1/replace", api.token(Role.OPERATOR)).status_code == 403
    assert api.call("POST", "/nodes/ghost/replace", api.admin).status_code == 404
    r = api.call("POST", "/nodes/n1/replace", api.admin)
    assert r.status_code == 200 and r.json()["replace_by"] == "root", r.text
    assert api.report("n1", old, host("n1").to_dict()).status_code == 200  # still works until the join
    r = api.call("POST", "/agents/join", api.join_token(), json=body)
    assert r.status_code == 201, r.text
    assert api.report("n1", old, host("n1").to_dict()).status_code == 401
    assert "replacement allowed by root" in api.events(kind="node.rejoined")[0]["message"]
    # used up: the next join without proof is refused again
    assert api.call("POST", "/agents/join", api.join_token(), json=body).status_code == 409
    audit = api.get("/audit").json()
    assert any(e["action"] == "POST /api/v1/nodes/{name}/replace" and e["status_code"] == 200 for e in audit)


def test_join_tokens_always_run_out(api: Api) -> None:
    for bad in ({"uses": None}, {"uses": 0}, {"expires_in_s": None}, {"expires_in_s": 0}, {"uses": 10**6}):
        r = api.call("POST", "/join-tokens", api.admin, json={"name": "x", **bad})
        assert r.status_code == 422, (bad, r.text)
    made = api.call("POST", "/join-tokens", api.admin, json={"name": "d"}).json()
    assert made["uses"] == made["uses_left"] == 1
    from datetime import datetime

    lifetime = datetime.fromisoformat(made["expires_at"]) - datetime.fromisoformat(made["created_at"])
    assert lifetime.total_seconds() == 86400


def test_join_refusals(api: Api) -> None:
    body = {"hostname": "n1", "snapshot": host("n1").to_dict()}
    assert api.call("POST", "/agents/join", None, json=body).status_code == 401
    assert api.call("POST", "/agents/join", api.admin, json=body).status_code == 401  # not a join token
    revoked = api.call("POST", "/join-tokens", api.admin, json={"name": "r"}).json()
    assert api.call("DELETE", f"/join-tokens/{revoked['id']}", api.admin).status_code == 200
    assert api.call("POST", "/agents/join", revoked["token"], json=body).status_code == 401
    mismatch = {"hostname": "n2", "snapshot": host("n1").to_dict()}
    r = api.call("POST", "/agents/join", api.join_token(), json=mismatch)
    assert r.status_code == 422 and "does not match" in r.text
    assert api.get("/nodes").json() == []


def test_revoked_token_stops_working(api: Api) -> None:
    r = api.call("POST", "/tokens", api.admin, json={"name": "tmp", "role": "operator"})
    token, token_id = r.json()["token"], r.json()["id"]
    assert api.get("/nodes", token).status_code == 200
    assert api.call("DELETE", f"/tokens/{token_id}", api.admin).status_code == 200
    assert api.get("/nodes", token).status_code == 401
    listed = {t["id"]: t for t in api.get("/tokens").json()}
    assert listed[token_id]["revoked"] is True and "token" not in listed[token_id]


def test_node_tokens_cannot_be_created_directly(api: Api) -> None:
    r = api.call("POST", "/tokens", api.admin, json={"name": "n", "role": "node"})
    assert r.status_code == 422 and "join" in r.text


def test_metrics_need_a_token_unless_public(api: Api) -> None:
    assert api.client.get("/metrics").status_code == 401
    r = api.client.get("/metrics", headers=api.headers(api.token(Role.VIEWER)))
    assert r.status_code == 200 and "gpumode_sync_seconds" in r.text
    api.client.app.state.gpumode.settings.metrics_public = True  # type: ignore[attr-defined]
    assert api.client.get("/metrics").status_code == 200


def test_metrics_count_hosts_and_cards(api: Api) -> None:
    api.join("n1", gpus=3)
    text = api.client.get("/metrics", headers=api.headers(api.admin)).text
    assert 'gpumode_hosts{mode="accel"} 1.0' in text
    assert 'gpumode_cards{kind="accel",status="free"} 3.0' in text


def test_expired_join_token_is_refused(api: Api) -> None:
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import update

    from gpumode.server.models import JoinToken

    secret = api.join_token(uses=5)
    with api.engine.begin() as conn:
        conn.execute(update(JoinToken).values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    r = api.call("POST", "/agents/join", secret, json={"hostname": "n1", "snapshot": host("n1").to_dict()})
    assert r.status_code == 401 and "expired" in r.json()["detail"]
    assert api.get("/nodes").json() == []


def test_multi_use_join_token_counts_down(api: Api) -> None:
    secret = api.join_token(uses=2)
    for name in ("n1", "n2", "n3"):
        r = api.call(
            "POST", "/agents/join", secret, json={"hostname": name, "snapshot": host(name).to_dict()}
        )
        assert r.status_code == (201 if name != "n3" else 401), (name, r.text)
    assert [t["uses_left"] for t in api.get("/join-tokens").json() if t["name"] == "test"] == [0]
