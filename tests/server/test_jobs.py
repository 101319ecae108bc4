"""Switch jobs on the server: dry runs, one active job per node (also under concurrency, two apps on one
database), the agent's work API and its permissions, cancel, cloud steps, recovery, rollouts, metrics.

The agent is played here through the API (claim, step reports, host result, fresh snapshot); the real agent
on emulated hosts is in ``tests/agent``.
"""

from __future__ import annotations

import threading
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from gpumode.domain import Mode
from gpumode.server import db
from gpumode.server.app import create_app
from gpumode.server.auth import Role
from gpumode.server.models import Job
from gpumode.server.settings import Settings

from .builders import host
from .conftest import Api

PASSTHROUGH = {"mode": "passthrough", "vm_policy": "gpu"}


def job_count(engine: Engine) -> int:
    with db.make_sessionmaker(engine)() as session:
        return int(session.scalar(select(func.count()).select_from(Job)) or 0)


def switch(api: Api, node: str, body: dict[str, Any], token: str | None = None, **params: Any) -> Any:
    return api.call("POST", f"/nodes/{node}/switch", token or api.admin, json=body, params=params)


def claim(api: Api, node: str, token: str) -> dict[str, Any]:
    r = api.call("GET", f"/nodes/{node}/work", token, params={"wait": 0})
    assert r.status_code == 200, r.text
    job: dict[str, Any] = r.json()["job"]
    return job


def finish_host(api: Api, node: str, token: str, job: dict[str, Any], mode: Mode = Mode.PASSTHROUGH) -> Any:
    """Play the agent: every host step done, the fresh snapshot, then the host's result."""
    steps = [{"step": s["id"], "state": "done"} for s in job["plan"]["steps"] if s["where"] == "host"]
    assert api.call("POST", f"/jobs/{job['id']}/events", token, json={"steps": steps}).status_code == 200
    assert api.report(node, token, host(node, 2, mode=mode).to_dict()).status_code == 200
    return api.call("POST", f"/jobs/{job['id']}/events", token, json={"host": {"result": "done"}})


def test_dry_run_returns_the_plan_and_stores_nothing(api: Api) -> None:
    api.join("n1")
    before = len(api.events())
    audited = len(api.get("/audit").json())
    r = switch(api, "n1", PASSTHROUGH, dry_run="true")
    assert r.status_code == 200, r.text
    steps = [s["action"] for s in r.json()["plan"]["steps"]]
    assert "bind.vfio" in steps and steps[-2:] == ["cloud.register_cards", "cloud.deploy_env"]
    assert job_count(api.engine) == 0
    assert len(api.events()) == before
    assert len(api.get("/audit").json()) == audited


def test_bad_requests_are_refused_with_the_policy_code(api: Api) -> None:
    api.join("n1")
    r = switch(api, "n1", {"mode": "vgpu"})
    assert r.status_code == 422
    assert r.json()["detail"]["code"] == "vgpu_type_required"
    assert "NVIDIA H100XM-4C" in r.json()["detail"]["choices"]
    assert switch(api, "n1", {"mode": "none"}).status_code == 422
    assert (
        switch(api, "n1", {"mode": "accel", "gpus": ["0000:99:00.0"]}).json()["detail"]["code"]
        == "unknown_gpu"
    )
    assert (
        switch(api, "n1", {"mode": "vgpu", "profile": "nope"}).json()["detail"]["code"] == "unknown_profile"
    )
    assert switch(api, "nowhere", PASSTHROUGH).status_code == 404
    r = api.call("PUT", "/modes", api.admin, json={"platform": ["accel", "vgpu"]})
    assert r.status_code == 200
    assert switch(api, "n1", PASSTHROUGH).json()["detail"]["code"] == "mode_not_allowed"
    assert job_count(api.engine) == 0


def test_profile_gives_the_vgpu_type_and_count(api: Api) -> None:
    api.join("n1")
    body = {"vgpu_type": "NVIDIA H100XM-40C", "count_per_gpu": 2}
    assert api.call("PUT", "/profiles/big", api.admin, json=body).status_code == 200
    r = switch(api, "n1", {"mode": "vgpu", "profile": "big"}, dry_run="true")
    assert r.status_code == 200, r.text
    creates = [s for s in r.json()["plan"]["steps"] if s["action"] == "vgpu.create"]
    assert len(creates) == 4 and {s["params"]["name"] for s in creates} == {"NVIDIA H100XM-40C"}


def test_roles_and_node_tokens(api: Api) -> None:
    n1, n2 = api.join("n1"), api.join("n2")
    viewer, operator = api.token(Role.VIEWER), api.token(Role.OPERATOR)
    assert switch(api, "n1", PASSTHROUGH, viewer).status_code == 403
    assert switch(api, "n1", PASSTHROUGH, n1).status_code == 403
    r = switch(api, "n1", PASSTHROUGH, operator)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    # work and reports: only the node's own agent
    assert api.call("GET", "/nodes/n1/work", n2, params={"wait": 0}).status_code == 403
    assert api.call("GET", "/nodes/n1/work", api.admin, params={"wait": 0}).status_code == 403
    assert api.call("GET", "/nodes/n1/work", None, params={"wait": 0}).status_code == 401
    assert api.report("n1", n2, host("n1", 2).to_dict()).status_code == 403
    assert api.call("GET", "/nodes/n2/work", n2, params={"wait": 0}).status_code == 204
    job = claim(api, "n1", n1)
    assert job["id"] == job_id
    step = {"steps": [{"step": job["plan"]["steps"][0]["id"], "state": "running"}]}
    assert api.call("POST", f"/jobs/{job_id}/events", n2, json=step).status_code == 403
    assert api.call("POST", f"/jobs/{job_id}/events", api.admin, json=step).status_code == 403
    assert api.call("GET", f"/jobs/{job_id}", n2).status_code == 403
    assert api.call("GET", f"/jobs/{job_id}", n1).status_code == 200
    assert api.call("POST", f"/jobs/{job_id}/cancel", viewer).status_code == 403


def test_a_job_from_claim_to_success(api: Api) -> None:
    token = api.join("n1")
    r = switch(api, "n1", PASSTHROUGH)
    assert r.status_code == 201, r.text
    assert r.json()["state"] == "queued"
    assert {s["state"] for s in r.json()["steps"]} == {"pending"}
    job = claim(api, "n1", token)
    assert api.get(f"/jobs/{job['id']}").json()["state"] == "running"
    # a re-delivery (an agent that restarted) hands out the same job
    assert claim(api, "n1", token)["id"] == job["id"]
    first = job["plan"]["steps"][0]["id"]
    r = api.call(
        "POST", f"/jobs/{job['id']}/events", token, json={"steps": [{"step": first, "state": "running"}]}
    )
    assert r.json() == {"job": job["id"], "state": "running", "cancel_requested": False}
    shown = api.get(f"/jobs/{job['id']}").json()["steps"][0]
    assert shown["state"] == "running" and shown["started_at"] and shown["finished_at"] is None
    bad = {"steps": [{"step": "99-nothing", "state": "done"}]}
    assert api.call("POST", f"/jobs/{job['id']}/events", token, json=bad).status_code == 422
    r = finish_host(api, "n1", token, job)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "succeeded"
    done = api.get(f"/jobs/{job['id']}").json()
    assert {s["state"] for s in done["steps"]} == {"done"}
    assert done["host_state"] == "done" and done["finished_at"]
    assert {c["kind"] for c in api.cards(node="n1")} == {"passthrough"}
    assert api.events(kind="job.")[0]["kind"] == "job.succeeded"
    # the job is over: the agent's late repeat is refused, nothing changes
    late = api.call("POST", f"/jobs/{job['id']}/events", token, json={"host": {"result": "done"}})
    assert late.status_code == 409
    assert api.call("GET", "/nodes/n1/work", token, params={"wait": 0}).status_code == 204
    assert switch(api, "n1", {"mode": "accel"}).status_code == 201  # no active job any more


def test_cloud_step_fails_when_the_host_does_not_show_the_mode(api: Api) -> None:
    token = api.join("n1")
    job = claim(api, "n1", token) if switch(api, "n1", PASSTHROUGH).status_code == 201 else {}
    r = finish_host(api, "n1", token, job, mode=Mode.ACCEL)  # the host came back still in accel
    assert r.json()["state"] == "failed"
    body = api.get(f"/jobs/{job['id']}").json()
    assert "is accel on the host" in body["error"]
    assert [s["state"] for s in body["steps"][-2:]] == ["failed", "skipped"]


def test_one_active_job_per_node(api: Api) -> None:
    api.join("n1")
    first = switch(api, "n1", PASSTHROUGH)
    assert first.status_code == 201
    second = switch(api, "n1", {"mode": "accel"})
    assert second.status_code == 409
    assert second.json()["detail"]["job"] == first.json()["id"]
    assert job_count(api.engine) == 1


def test_concurrent_requests_on_two_servers_accept_exactly_one(api: Api, settings: Settings) -> None:
    """Two apps with their own connection pools (as two server processes) on one database."""
    api.join("n1")
    other_engine = db.make_engine(settings.db)
    try:
        with TestClient(create_app(settings, engine=other_engine)) as other:
            clients = [api.client, other] * 3
            barrier = threading.Barrier(len(clients))
            codes: list[int] = []

            def go(client: TestClient) -> None:
                barrier.wait()
                r = client.post("/api/v1/nodes/n1/switch", json=PASSTHROUGH, headers=api.headers(api.admin))
                codes.append(r.status_code)

            threads = [threading.Thread(target=go, args=(c,)) for c in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        other_engine.dispose()
    assert sorted(codes) == [201] + [409] * (len(clients) - 1), codes
    assert job_count(api.engine) == 1


def test_cancel_queued_and_running_jobs(api: Api) -> None:
    token = api.join("n1")
    queued = switch(api, "n1", PASSTHROUGH).json()
    r = api.call("POST", f"/jobs/{queued['id']}/cancel", api.admin)
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert api.call("POST", f"/jobs/{queued['id']}/cancel", api.admin).status_code == 409
    assert api.call("GET", "/nodes/n1/work", token, params={"wait": 0}).status_code == 204

    running = switch(api, "n1", PASSTHROUGH).json()
    job = claim(api, "n1", token)
    r = api.call("POST", f"/jobs/{running['id']}/cancel", api.admin)
    assert r.json()["state"] == "running" and r.json()["cancel_requested"] is True
    first = job["plan"]["steps"][0]["id"]
    ack = api.call(
        "POST", f"/jobs/{job['id']}/events", token, json={"steps": [{"step": first, "state": "done"}]}
    )
    assert ack.json()["cancel_requested"] is True  # the agent learns it with its next step report
    undone = {"steps": [{"step": first, "state": "undone"}], "host": {"result": "rolled_back"}}
    r = api.call("POST", f"/jobs/{job['id']}/events", token, json=undone)
    assert r.json()["state"] == "rolled_back"
    body = api.get(f"/jobs/{job['id']}").json()
    assert body["steps"][0]["state"] == "undone" and "cancel requested by root" in body["error"]


def test_long_poll_wakes_when_a_job_arrives(api: Api) -> None:
    token = api.join("n1")
    answer: dict[str, Any] = {}

    def poll() -> None:
        answer["r"] = api.call("GET", "/nodes/n1/work", token, params={"wait": 10})

    t = threading.Thread(target=poll)
    t.start()
    threading.Event().wait(0.3)
    created = switch(api, "n1", PASSTHROUGH).json()
    t.join(timeout=5)
    assert not t.is_alive(), "the long poll did not wake up"
    assert answer["r"].status_code == 200 and answer["r"].json()["job"]["id"] == created["id"]


def test_a_restarted_server_finishes_cloud_steps(api: Api, settings: Settings) -> None:
    token = api.join("n1")
    job = claim(api, "n1", token) if switch(api, "n1", PASSTHROUGH).status_code == 201 else {}
    assert api.report("n1", token, host("n1", 2, mode=Mode.PASSTHROUGH).to_dict()).status_code == 200
    with db.make_sessionmaker(api.engine).begin() as session:  # the server died right after the host part
        stored = session.get(Job, job["id"])
        assert stored is not None
        stored.host_state = "done"
    with TestClient(create_app(settings, engine=api.engine)):
        pass  # startup runs the recovery
    assert api.get(f"/jobs/{job['id']}").json()["state"] == "succeeded"


def test_reported_vms_are_stored_and_planned_with(api: Api) -> None:
    token = api.join("n1")
    body = host("n1", 2).to_dict()
    body["vms"] = [
        {"name": "vm-a", "uuid": "u-a", "running": True, "devices": [{"kind": "pci", "id": "0000:1b:00.0"}]}
    ]
    r = api.report("n1", token, body)
    assert r.status_code == 200 and r.json()["changed"] is False  # VMs are not hardware
    plan = switch(api, "n1", PASSTHROUGH, dry_run="true").json()["plan"]
    assert plan["steps"][0]["action"] == "vm.shutdown" and plan["impact"]["vms_stopped"] == ["vm-a"]
    assert (
        switch(api, "n1", {**PASSTHROUGH, "vm_policy": "refuse"}).json()["detail"]["code"]
        == "vm_policy_refused"
    )
    body["vms"][0]["devices"][0]["kind"] = "usb"
    assert api.report("n1", token, body).status_code == 422


def test_rollout_concurrency_and_failure_budget(api: Api) -> None:
    tokens = {n: api.join(n) for n in ("r1", "r2", "r3", "r4")}
    assert api.call("PUT", "/groups/fleet", api.admin, json={"nodes": list(tokens)}).status_code == 200
    dry = api.call("POST", "/groups/fleet/switch", api.admin, json=PASSTHROUGH, params={"dry_run": "true"})
    assert dry.status_code == 200 and sorted(dry.json()["plans"]) == sorted(tokens)
    assert job_count(api.engine) == 0
    body = {**PASSTHROUGH, "concurrency": 2, "max_failures": 0}
    r = api.call("POST", "/groups/fleet/switch", api.admin, json=body)
    assert r.status_code == 201, r.text
    rollout = r.json()
    assert [n["state"] for n in rollout["nodes"]] == ["queued", "queued", "pending", "pending"]
    # r1 succeeds: r3 starts
    assert finish_host(api, "r1", tokens["r1"], claim(api, "r1", tokens["r1"])).json()["state"] == "succeeded"
    states = [n["state"] for n in api.get(f"/rollouts/{rollout['id']}").json()["nodes"]]
    assert states == ["succeeded", "queued", "queued", "pending"]
    # r2 fails: over budget, r4 never starts; the rollout ends when r3 ends
    job = claim(api, "r2", tokens["r2"])
    r = api.call(
        "POST", f"/jobs/{job['id']}/events", tokens["r2"], json={"host": {"result": "failed", "error": "x"}}
    )
    assert r.json()["state"] == "failed"
    mid = api.get(f"/rollouts/{rollout['id']}").json()
    assert mid["state"] == "running" and mid["failures"] == 1 and mid["nodes"][3]["state"] == "pending"
    finish_host(api, "r3", tokens["r3"], claim(api, "r3", tokens["r3"]))
    end = api.get(f"/rollouts/{rollout['id']}").json()
    assert end["state"] == "failed"
    assert [n["state"] for n in end["nodes"]] == ["succeeded", "failed", "succeeded", "pending"]
    assert api.call("POST", "/groups/nope/switch", api.admin, json=body).status_code == 404


def test_cancelling_a_rollout_cancels_its_queued_jobs_and_starts_no_more(api: Api) -> None:
    tokens = {n: api.join(n) for n in ("c1", "c2", "c3")}
    assert api.call("PUT", "/groups/fleet", api.admin, json={"nodes": list(tokens)}).status_code == 200
    body = {**PASSTHROUGH, "concurrency": 2, "max_failures": 0}
    rollout = api.call("POST", "/groups/fleet/switch", api.admin, json=body).json()
    running = claim(api, "c1", tokens["c1"])
    viewer = api.token(Role.VIEWER)
    assert api.call("POST", f"/rollouts/{rollout['id']}/cancel", viewer).status_code == 403

    r = api.call("POST", f"/rollouts/{rollout['id']}/cancel", api.admin)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "cancelled"
    assert [n["state"] for n in r.json()["nodes"]] == ["running", "cancelled", "pending"]
    queued = api.get(f"/jobs/{r.json()['nodes'][1]['job']}").json()
    assert "rollout " + str(rollout["id"]) + " cancelled" in queued["error"]
    assert [e["node"] for e in api.events(kind="job.cancelled")] == ["c2"]
    assert api.call("POST", f"/rollouts/{rollout['id']}/cancel", api.admin).status_code == 409
    # the running job finishes as it would; the rollout starts nothing after it
    assert finish_host(api, "c1", tokens["c1"], running).json()["state"] == "succeeded"
    end = api.get(f"/rollouts/{rollout['id']}").json()
    assert end["state"] == "cancelled" and [n["state"] for n in end["nodes"]] == [
        "succeeded",
        "cancelled",
        "pending",
    ]
    assert api.call("POST", "/rollouts/999999/cancel", api.admin).status_code == 404


def test_metrics_count_jobs_by_state(api: Api) -> None:
    api.join("n1")
    switch(api, "n1", PASSTHROUGH)
    text = api.client.get("/metrics", headers=api.headers(api.admin)).text
    assert 'gpumode_jobs{state="queued"} 1.0' in text
    assert 'gpumode_jobs{state="succeeded"} 0.0' in text


def test_a_cancel_after_the_host_steps_finished_rolls_back_as_it_says(api: Api) -> None:
    """The agent finished every host step but had not yet reported the result when the cancel came: the
    cancel said the host is rolled back, so the finished run is undone and the job ends rolled_back saying
    so, not succeeded with a cancel message."""
    token = api.join("n1")
    job = claim(api, "n1", token) if switch(api, "n1", PASSTHROUGH).status_code == 201 else {}
    steps = [{"step": s["id"], "state": "done"} for s in job["plan"]["steps"] if s["where"] == "host"]
    assert api.call("POST", f"/jobs/{job['id']}/events", token, json={"steps": steps}).status_code == 200
    told = api.call("POST", f"/jobs/{job['id']}/cancel", api.admin).json()
    assert told["cancel_requested"] is True and "rolls the host back" in told["error"]
    again = api.call("POST", f"/jobs/{job['id']}/cancel", api.admin)  # asking twice changes nothing
    assert again.status_code == 200 and again.json()["error"] == told["error"]
    r = api.call("POST", f"/jobs/{job['id']}/events", token, json={"host": {"result": "done"}})
    assert r.json()["state"] == "running" and r.json()["cancel_requested"] is True  # undo the finished run
    assert all(c["kind"] != "passthrough" for c in api.cards(node="n1"))  # no cloud step ran
    undone = [{"step": s["step"], "state": "undone"} for s in reversed(steps)]
    r = api.call(
        "POST", f"/jobs/{job['id']}/events", token, json={"steps": undone, "host": {"result": "rolled_back"}}
    )
    end = api.get(f"/jobs/{job['id']}").json()
    assert r.json()["state"] == end["state"] == "rolled_back", end
    assert end["error"].startswith("cancel requested by root") and "the host was rolled back" in end["error"]
    assert api.events(kind="job.")[0]["kind"] == "job.rolled_back"
