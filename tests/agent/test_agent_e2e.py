"""The agent and the server over real HTTP, on emulated hosts: a switch end to end, then the crashes — the
agent killed mid-job (resume), cancelled while it was down (rollback), the server killed mid-job (the agent
retries, the restarted server finishes the job)."""

from __future__ import annotations

import os
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpumode.domain import Mode
from gpumode.emulated.fixtures.mini import L40S, mini_host
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.modes.journal import JournalStore
from gpumode.modes.run import FAULT_ENV

from .conftest import Agent, Server, emulated, wait_for

AgentFactory = Callable[[Host], Agent]


def joined(server: Server, name: str) -> dict[str, Any] | None:
    r = server.call("GET", f"/nodes/{name}")
    return r.json() if r.status_code == 200 else None


def modes(host: Host) -> dict[str, str]:
    return {g.address: g.mode.value for g in discover(host).gpus}


def test_switch_accel_to_vgpu_end_to_end(server: Server, agents: AgentFactory, tmp_path: Path) -> None:
    spec = replace(mini_host("accel", L40S, gpus=2), hostname="l40s-e2e")
    host = emulated(spec, tmp_path / "host", key="mini-l40s-accel-2")
    agent = agents(host)
    agent.start()
    node = wait_for(lambda: joined(server, "l40s-e2e"), 30, "the agent to join")
    assert {g["mode"] for g in node["gpus"]} == {"accel"}
    config = host.path("etc/gpumode/agent.json")
    wait_for(config.exists, 10, "the node token to be stored")  # written once the join answer is in
    assert stat.S_IMODE(config.stat().st_mode) == 0o600

    body = {"mode": "vgpu", "vgpu_type": "NVIDIA L40S-4Q", "vgpu_count": 2}
    dry = server.call("POST", "/nodes/l40s-e2e/switch", json=body, params={"dry_run": "true"})
    assert dry.status_code == 200, dry.text
    assert server.get("/jobs") == []

    r = server.call("POST", "/nodes/l40s-e2e/switch", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["plan"] == dry.json()["plan"]  # the plan shown is the plan stored
    job = server.wait_job(r.json()["id"], {"succeeded", "failed", "rolled_back"})
    assert job["state"] == "succeeded", (job["error"], agent.output()[-3000:])
    assert {s["state"] for s in job["steps"] if s["where"] == "host"} <= {"done", "skipped"}
    assert {s["state"] for s in job["steps"] if s["where"] == "cloud"} == {"done"}

    # the server's inventory and cards are what the host shows
    snapshot = discover(host)
    assert {g.mode for g in snapshot.gpus} == {Mode.VGPU}
    node = server.get("/nodes/l40s-e2e")
    assert {g["address"]: g["mode"] for g in node["gpus"]} == modes(host)
    assert node["fingerprint"] == snapshot.fingerprint
    cards = server.get("/cards", params={"node": "l40s-e2e"})
    vgpus = sorted(vf for g in snapshot.gpus for vf in g.vgpus)
    assert len(vgpus) == 4
    assert sorted(c["device"] for c in cards) == vgpus and {c["kind"] for c in cards} == {"vgpu"}

    assert agent.stop() == 0  # SIGTERM while idle: a clean stop
    assert "agent stopped" in agent.output()


def test_agent_killed_mid_job_resumes_and_finishes(
    server: Server, agents: AgentFactory, tmp_path: Path
) -> None:
    host = emulated("t4-mdev", tmp_path / "host")
    agent = agents(host)
    agent.start(env={FAULT_ENV: "after:3"})  # SIGKILLs itself once step 3 is applied, before it is recorded
    wait_for(lambda: joined(server, "t4-edge-02"), 30, "the agent to join")
    r = server.call("POST", "/nodes/t4-edge-02/switch", json={"mode": "accel"})
    assert r.status_code == 201, r.text
    assert agent.wait_exit(60) == -signal.SIGKILL
    assert server.job(r.json()["id"])["state"] == "running"
    assert JournalStore(host).unfinished() is not None

    agent.start()  # no fault this time
    job = server.wait_job(r.json()["id"], {"succeeded", "failed", "rolled_back"})
    assert job["state"] == "succeeded", (job["error"], agent.output()[-3000:])
    assert set(modes(host).values()) == {"accel"}
    assert JournalStore(host).unfinished() is None
    assert "resuming the run a restart interrupted" in agent.output()
    assert {s["state"] for s in job["steps"] if s["where"] == "host"} <= {"done", "skipped"}


def test_cancel_while_the_agent_is_down_rolls_back(
    server: Server, agents: AgentFactory, tmp_path: Path
) -> None:
    host = emulated("t4-mdev", tmp_path / "host")
    before = modes(host)
    agent = agents(host)
    agent.start(env={FAULT_ENV: "after:4"})
    wait_for(lambda: joined(server, "t4-edge-02"), 30, "the agent to join")
    job_id = server.call("POST", "/nodes/t4-edge-02/switch", json={"mode": "accel"}).json()["id"]
    assert agent.wait_exit(60) == -signal.SIGKILL
    r = server.call("POST", f"/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["cancel_requested"] is True

    agent.start()
    job = server.wait_job(job_id, {"succeeded", "failed", "rolled_back"})
    assert job["state"] == "rolled_back", (job["error"], agent.output()[-3000:])
    assert "cancel requested by root" in job["error"]
    assert modes(host) == before
    touched = [s for s in job["steps"][:4] if s["where"] == "host"]
    assert {s["state"] for s in touched} <= {"undone", "skipped"}
    assert server.get("/nodes/t4-edge-02")["gpus"][0]["mode"] == before[next(iter(before))]


def test_server_killed_mid_job_restarts_and_the_job_finishes(
    server: Server, agents: AgentFactory, tmp_path: Path
) -> None:
    host = emulated("t4-mdev", tmp_path / "host")
    agent = agents(host)
    agent.start()
    wait_for(lambda: joined(server, "t4-edge-02"), 30, "the agent to join")
    job_id = server.call("POST", "/nodes/t4-edge-02/switch", json={"mode": "accel"}).json()["id"]
    wait_for(lambda: server.job(job_id)["state"] != "queued", 30, "the agent to take the job")
    server.kill()
    time.sleep(1.0)  # the agent works on, its reports fail and back off
    server.start()
    job = server.wait_job(job_id, {"succeeded", "failed", "rolled_back"})
    assert job["state"] == "succeeded", (job["error"], agent.output()[-3000:])
    assert set(modes(host).values()) == {"accel"}
    assert {s["state"] for s in job["steps"] if s["where"] == "host"} <= {"done", "skipped"}
    assert {c["kind"] for c in server.get("/cards", params={"node": "t4-edge-02"})} == {"accel"}
    assert os.path.exists(host.path("etc/gpumode/agent.json"))
