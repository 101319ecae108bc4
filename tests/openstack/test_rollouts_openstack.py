"""Rollouts with ``cloud = "openstack"``: every job a rollout starts is planned with the platform, so it
delivers nova-compute's drop-in and restarts it like a single switch does — the first jobs (started when
the rollout is created) and the later ones (started when an earlier job ends).

The server is the real app in-process (TestClient) on SQLite, configured for the REAL Placement of the
session; the agent is played through the API with the node's own token, as in ``tests/server``. Two
emulated T4 hosts (one fixture, two hostnames) keep it fast.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpumode.cloud.openstack.config import OpenStackConfig
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.server import db
from gpumode.server.app import create_app
from gpumode.server.auth import Role, create_user_token
from gpumode.server.settings import Settings

from .services import PlacementAdmin

DROPIN = "/etc/nova/nova.conf.d/gpumode.conf"
RESTART = ["systemctl", "restart", "nova-compute"]
NODES = ("t4-a", "t4-b")


@dataclass
class OpenStackApi:
    client: TestClient
    admin: str
    tokens: dict[str, str]

    def call(self, method: str, path: str, token: str | None = None, **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {token or self.admin}"}
        return self.client.request(method, f"/api/v1{path}", headers=headers, **kw)


@pytest.fixture
def api(tmp_path: Path, placement: PlacementAdmin, t4_template: Path) -> Iterator[OpenStackApi]:
    db_url = str(tmp_path / "gpumode.db")
    engine = db.make_engine(db_url)
    db.upgrade(engine)
    with db.make_sessionmaker(engine).begin() as session:
        _, admin = create_user_token(session, "root", Role.ADMIN, created_by="test")
    config = OpenStackConfig(
        auth_type="noauth",
        placement_endpoint=str(placement.http.base_url).rstrip("/"),
        pci_in_placement=True,
        nova_dropin=DROPIN,
        restart_command=RESTART,
    )
    settings = Settings(db=db_url, cloud="openstack", openstack=config)
    snapshot = discover(Host(t4_template))
    try:
        with TestClient(create_app(settings, engine=engine)) as client:
            api = OpenStackApi(client, admin, {})
            join = api.call("POST", "/join-tokens", json={"name": "test", "uses": 1000}).json()["token"]
            for name in NODES:
                renamed = replace(snapshot, hostname=name)
                renamed.fingerprint = renamed.compute_fingerprint()
                body = {"hostname": name, "snapshot": renamed.to_dict()}
                r = api.call("POST", "/agents/join", join, json=body)
                assert r.status_code == 201, r.text
                api.tokens[name] = r.json()["token"]
            r = api.call("PUT", "/groups/edge", json={"nodes": list(NODES)})
            assert r.status_code == 200, r.text
            yield api
    finally:
        engine.dispose()


def platform_steps(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """The steps OpenStack adds to a plan: the rollback guard first, the drop-in and the restart last."""
    actions = [(s["action"], s["target"]) for s in plan["steps"]]
    return [actions[0], *actions[-4:-2]]


def test_every_job_of_a_rollout_carries_the_platforms_host_steps(api: OpenStackApi) -> None:
    body = {"mode": "passthrough", "vm_policy": "gpu", "concurrency": 1, "max_failures": 1}
    dry = api.call("POST", "/groups/edge/switch", json=body, params={"dry_run": "true"})
    assert dry.status_code == 200, dry.text
    plans = dry.json()["plans"]
    wanted = [
        ("command.run", "nova-compute-rollback"),
        ("file.write", DROPIN),
        ("command.run", "nova-compute"),
    ]
    assert {n: platform_steps(p) for n, p in plans.items()} == {n: wanted for n in NODES}

    r = api.call("POST", "/groups/edge/switch", json=body)
    assert r.status_code == 201, r.text
    rollout = r.json()
    first = api.call("GET", f"/jobs/{rollout['nodes'][0]['job']}").json()
    assert first["node"] == "t4-a" and first["rollout"] == rollout["id"]
    assert first["plan"] == plans["t4-a"]  # started by the rollout, planned as the dry run showed
    assert first["cloud"] is None  # the platform has done nothing yet

    # The agent takes the job: the platform checks Placement and takes its hold, which the job shows.
    work = api.call("GET", "/nodes/t4-a/work", api.tokens["t4-a"], params={"wait": 0})
    assert work.status_code == 200, work.text
    assert api.call("GET", f"/jobs/{first['id']}").json()["cloud"] == {
        "hold": {},  # no Nova configured: nothing to disable
        "released": False,
        "problems": [],
    }
    # It fails on the host: the rollout (budget 1) starts the next node, again with the platform's steps.
    failed = {"host": {"result": "failed", "error": "injected"}}
    r = api.call("POST", f"/jobs/{first['id']}/events", api.tokens["t4-a"], json=failed)
    assert r.status_code == 200 and r.json()["state"] == "failed", r.text
    assert api.call("GET", f"/jobs/{first['id']}").json()["cloud"]["released"] is True
    after = api.call("GET", f"/rollouts/{rollout['id']}").json()
    assert [n["state"] for n in after["nodes"]] == ["failed", "queued"]
    second = api.call("GET", f"/jobs/{after['nodes'][1]['job']}").json()
    assert platform_steps(second["plan"]) == wanted
    assert second["plan"] == plans["t4-b"]
