"""``gpumode rollout start|show|cancel`` and ``gpumode rollouts`` against the real loopback server; ``--wait``
with a real agent on the emulated T4 host."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from gpumode.cli.client import EXIT_AUTH, EXIT_BAD_INPUT, EXIT_CONFLICT, EXIT_FAILED

from .remote_support import Fleet, fleet, t4_agent

__all__ = ["fleet", "t4_agent"]


@pytest.fixture
def group(fleet: Fleet, request: pytest.FixtureRequest) -> Iterator[str]:
    """A host group of the nodes the test names (``@pytest.mark.parametrize("group", [...], indirect=True)``),
    removed afterwards so the session's other tests see no groups."""
    name = "cli-rollout"
    r = fleet.api("PUT", f"/groups/{name}", json={"nodes": list(request.param)})
    assert r.status_code == 200, r.text
    yield name
    fleet.api("DELETE", f"/groups/{name}")


@pytest.mark.parametrize("group", [["t4-edge-02", "ws-cad-12"]], indirect=True)
def test_dry_run_start_list_show_cancel(fleet: Fleet, group: str) -> None:
    r = fleet.cli("rollout", "start", group, "--mode", "accel", "--dry-run")
    assert r.exit_code == 0, r.output
    assert f"rollout plan for group {group}: accel on 2 node(s)" in r.stdout
    assert "t4-edge-02" in r.stdout and "ws-cad-12" in r.stdout and "passthrough → accel" in r.stdout
    r = fleet.cli("rollout", "start", group, "--mode", "accel", "--dry-run", "--json")
    assert sorted(json.loads(r.stdout)["plans"]) == ["t4-edge-02", "ws-cad-12"]
    assert fleet.api("GET", "/rollouts").json() == []

    r = fleet.cli("rollout", "start", group, "--mode", "accel", "--count", "2")
    assert r.exit_code == EXIT_BAD_INPUT and "go with --mode vgpu" in r.stderr
    r = fleet.cli("rollout", "start", "nope", "--mode", "accel")
    assert r.exit_code == EXIT_FAILED and "no host group named 'nope'" in r.stderr
    r = fleet.cli("rollout", "start", group, "--mode", "accel", token="viewer")
    assert r.exit_code == EXIT_AUTH and "operator role" in r.stderr

    r = fleet.cli(
        "rollout", "start", group, "--mode", "accel", "--concurrency", "1", "--failure-budget", "1",
        token="operator",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    rollout = fleet.api("GET", "/rollouts").json()[0]
    assert f"rollout {rollout['id']} {group}: accel (all GPUs)" in r.stdout
    assert "0/2 nodes, 0 failure(s) of 1 allowed, 1 at once" in r.stdout
    assert f"gpumode rollout show {rollout['id']} --wait" in r.stdout

    r = fleet.cli("rollouts")
    assert r.exit_code == 0 and group in r.stdout and "running" in r.stdout
    r = fleet.cli("rollouts", "--json")
    assert [x["id"] for x in json.loads(r.stdout)] == [rollout["id"]]
    r = fleet.cli("rollout", "show", str(rollout["id"]))
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()[:2] in ("t4", "ws")}
    assert "queued" in rows["t4-edge-02"] and f"job {rollout['nodes'][0]['job']}" in rows["t4-edge-02"]
    assert "pending" in rows["ws-cad-12"]

    r = fleet.cli("rollout", "cancel", str(rollout["id"]), token="operator")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == f"rollout {rollout['id']} cancelled"
    job = fleet.api("GET", f"/jobs/{rollout['nodes'][0]['job']}").json()
    assert job["state"] == "cancelled"  # it was queued: the rollout's cancel cancelled it
    r = fleet.cli("rollout", "cancel", str(rollout["id"]), token="operator")
    assert r.exit_code == EXIT_CONFLICT and "already cancelled" in r.stderr
    # `--wait` on a rollout that ended other than succeeded says so and exits 1
    r = fleet.cli("rollout", "show", str(rollout["id"]), "--wait")
    assert r.exit_code == EXIT_FAILED
    assert f"rollout {rollout['id']} cancelled" in r.stdout and "t4-edge-02 cancelled" in r.stdout


@pytest.mark.parametrize("group", [["t4-edge-02"]], indirect=True)
def test_start_wait_follows_the_rollout_to_success(
    fleet: Fleet, group: str, t4_agent: subprocess.Popen[bytes]
) -> None:
    r = fleet.cli("rollout", "start", group, "--mode", "passthrough", "--wait", token="operator")
    assert r.exit_code == 0, r.output
    lines = [line.strip() for line in r.stdout.splitlines()]
    rollout = fleet.api("GET", "/rollouts").json()[0]
    job = rollout["nodes"][0]["job"]
    assert lines[0] == f"rollout {rollout['id']} {group}: passthrough (all GPUs)"
    assert f"t4-edge-02 succeeded (job {job})" in lines
    assert f"rollout {rollout['id']} succeeded (1/1 nodes)" in lines
    assert lines[-1].startswith(f"rollout {rollout['id']} {group}: passthrough (all GPUs) — succeeded")
    assert t4_agent.poll() is None

    # The job shows what the cloud platform did around it: it held the node and gave it back.
    r = fleet.cli("job", str(job))
    assert r.exit_code == 0 and "cloud: node given back" in r.stdout
    assert json.loads(fleet.cli("job", str(job), "--json").stdout)["cloud"]["released"] is True
