"""The remote verbs against a real server on loopback: output, --json, exit codes and error lines."""

from __future__ import annotations

import json

from gpumode.cli.client import EXIT_AUTH, EXIT_BAD_INPUT, EXIT_CONFLICT, EXIT_FAILED

from .remote_support import Fleet, fleet

__all__ = ["fleet"]


def test_nodes_table_and_json(fleet: Fleet) -> None:
    r = fleet.cli("nodes")
    assert r.exit_code == 0, r.output
    assert "ws-cad-12" in r.stdout and "t4-edge-02" in r.stdout
    assert "passthrough" in r.stdout

    r = fleet.cli("nodes", "--json")
    assert r.exit_code == 0
    rows = json.loads(r.stdout)
    assert {n["name"]: n["mode"] for n in rows} == {"t4-edge-02": "none", "ws-cad-12": "passthrough"}
    assert {n["name"]: n["gpu_count"] for n in rows} == {"t4-edge-02": 4, "ws-cad-12": 1}

    r = fleet.cli("nodes", "--mode", "passthrough", "--json")
    assert [n["name"] for n in json.loads(r.stdout)] == ["ws-cad-12"]


def test_gpus_match_the_hosts(fleet: Fleet) -> None:
    from gpumode.host.discover import discover

    r = fleet.cli("gpus", "--json")
    assert r.exit_code == 0, r.output
    got = {(row["node"], row["address"], row["mode"]) for row in json.loads(r.stdout)}
    want = {
        (name, g.address, g.mode.value) for name, host in fleet.hosts.items() for g in discover(host).gpus
    }
    assert got == want and len(got) == 5

    r = fleet.cli("gpus", "--node", "t4-edge-02")
    assert r.exit_code == 0
    assert "t4-edge-02" in r.stdout and "ws-cad-12" not in r.stdout
    assert "0000:" in r.stdout


def test_unknown_node_is_one_line_and_exit_1(fleet: Fleet) -> None:
    r = fleet.cli("gpus", "--node", "nope")
    assert r.exit_code == EXIT_FAILED
    assert r.stderr.strip() == "error: 404: no node named 'nope'"
    assert r.stdout == ""


def test_cards_filters_and_bad_status(fleet: Fleet) -> None:
    r = fleet.cli("cards", "--json")
    cards = json.loads(r.stdout)
    assert [(c["node"], c["kind"], c["status"]) for c in cards] == [("ws-cad-12", "passthrough", "free")]

    r = fleet.cli("cards", "--node", "ws-cad-12")
    assert r.exit_code == 0 and "passthrough" in r.stdout and "free" in r.stdout
    r = fleet.cli("cards", "--status", "lost")
    assert r.exit_code == 0 and "no cards" in r.stdout

    r = fleet.cli("cards", "--status", "busy")
    assert r.exit_code == EXIT_BAD_INPUT
    assert "--status 'busy' is not one of: free, in_use, reserved, lost" in r.stderr


def test_events_per_node(fleet: Fleet) -> None:
    r = fleet.cli("events", "--node", "ws-cad-12", "--json")
    assert r.exit_code == 0
    events = json.loads(r.stdout)
    assert events and {e["node"] for e in events} == {"ws-cad-12"}
    assert "card.added" in {e["kind"] for e in events}
    r = fleet.cli("events", "--node", "ws-cad-12")
    assert "card.added" in r.stdout


def test_modes_show_and_set_need_admin(fleet: Fleet) -> None:
    r = fleet.cli("modes")
    assert r.exit_code == 0 and "accel, vgpu, passthrough" in r.stdout

    r = fleet.cli("modes", "set", "--model", "10de:1eb8=accel,passthrough", token="viewer")
    assert r.exit_code == EXIT_AUTH
    assert r.stderr.strip() == "error: 403: this call needs the admin role or higher"

    r = fleet.cli("modes", "set", "--model", "10de:1eb8=accel,passthrough", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["models"] == {"10de:1eb8": ["accel", "passthrough"]}
    assert json.loads(r.stdout)["platform"] == ["accel", "vgpu", "passthrough"]  # untouched

    r = fleet.cli("modes", "set", "--model", "10de:1eb8=")
    assert r.exit_code == 0
    assert fleet.api("GET", "/modes").json()["models"] == {}

    r = fleet.cli("modes", "set", "--platform", "accel,turbo")
    assert r.exit_code == EXIT_BAD_INPUT and "turbo is not a mode" in r.stderr
    r = fleet.cli("modes", "set", "--group", "nosuchgroup=accel")
    assert r.exit_code == EXIT_BAD_INPUT and "nosuchgroup" in r.stderr  # the server's 422, one line
    assert len(r.stderr.strip().splitlines()) == 1


def test_token_create_prints_a_working_secret(fleet: Fleet) -> None:
    r = fleet.cli("token", "create", "--role", "viewer", "--name", "dashboards")
    assert r.exit_code == 0, r.output
    secret = r.stdout.strip().splitlines()[-1]
    assert secret.startswith("gpmu_")
    assert fleet.cli("nodes", token=secret).exit_code == 0

    r = fleet.cli("token", "create", "--role", "admin", token="operator")
    assert r.exit_code == EXIT_AUTH and "403" in r.stderr
    r = fleet.cli("token", "create", "--role", "node")
    assert r.exit_code == EXIT_BAD_INPUT

    r = fleet.cli("token", "list", "--json")
    assert "dashboards" in {t["name"] for t in json.loads(r.stdout)}


def test_join_token_prints_the_agent_command(fleet: Fleet) -> None:
    r = fleet.cli("token", "join", "--name", "rack-7", "--uses", "3")
    assert r.exit_code == 0, r.output
    assert "3 use(s)" in r.stdout
    assert f"gpumode agent --server {fleet.url} --token gpmj_" in r.stdout


def test_join_tokens_listed_and_revoked_and_a_replacement_allowed(fleet: Fleet) -> None:
    r = fleet.cli("token", "join", "--name", "rack-9", "--json")
    made = json.loads(r.stdout)
    r = fleet.cli("token", "joins")
    assert r.exit_code == 0 and "rack-9" in r.stdout and "1 of 1" in r.stdout, r.output
    r = fleet.cli("token", "revoke-join", str(made["id"]))
    assert r.exit_code == 0 and "revoked join token 'rack-9'" in r.stdout, r.output
    listed = {t["id"]: t for t in json.loads(fleet.cli("token", "joins", "--json").stdout)}
    assert listed[made["id"]]["revoked"] is True
    assert fleet.cli("token", "join", "--uses", "0").exit_code == EXIT_BAD_INPUT
    r = fleet.cli("token", "replace", "ws-cad-12")
    assert r.exit_code == 0 and "the next join as ws-cad-12" in r.stdout, r.output
    assert fleet.cli("token", "replace", "no-such-node").exit_code != 0


def test_switch_dry_run_shows_plan_and_impact_and_stores_nothing(fleet: Fleet) -> None:
    r = fleet.cli("switch", "t4-edge-02", "--mode", "accel", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "plan for t4-edge-02: accel" in r.stdout
    assert "impact" in r.stdout and "none → accel" in r.stdout
    assert fleet.api("GET", "/jobs").json() == []

    r = fleet.cli("switch", "t4-edge-02", "--mode", "accel", "--dry-run", "--json")
    plan = json.loads(r.stdout)["plan"]
    assert plan["hostname"] == "t4-edge-02" and plan["steps"]


def test_switch_refused_by_policy_is_one_line_exit_2(fleet: Fleet) -> None:
    r = fleet.cli("switch", "t4-edge-02", "--mode", "vgpu", "--vgpu-type", "NOPE-1Q", "--dry-run")
    assert r.exit_code == EXIT_BAD_INPUT, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: 422: ")

    r = fleet.cli("switch", "t4-edge-02", "--mode", "accel", "--count", "2")
    assert r.exit_code == EXIT_BAD_INPUT and "go with --mode vgpu" in r.stderr

    r = fleet.cli("switch", "t4-edge-02", "--mode", "accel", token="viewer")
    assert r.exit_code == EXIT_AUTH and "operator role" in r.stderr


def test_job_queue_conflict_and_cancel(fleet: Fleet) -> None:
    r = fleet.cli("switch", "t4-edge-02", "--mode", "accel", "--json", token="operator")
    assert r.exit_code == 0, r.output
    job = json.loads(r.stdout)
    assert job["state"] == "queued" and job["node"] == "t4-edge-02"
    try:
        r = fleet.cli("switch", "t4-edge-02", "--mode", "accel", token="operator")
        assert r.exit_code == EXIT_CONFLICT
        assert f"job {job['id']}" in r.stderr and r.stderr.startswith("error: 409: ")

        r = fleet.cli("jobs")
        assert r.exit_code == 0 and "queued" in r.stdout and "t4-edge-02" in r.stdout
        r = fleet.cli("jobs", "--state", "queued", "--json")
        assert [j["id"] for j in json.loads(r.stdout)] == [job["id"]]
        r = fleet.cli("job", str(job["id"]))
        assert r.exit_code == 0 and f"job {job['id']}" in r.stdout and "queued" in r.stdout
    finally:
        r = fleet.cli("cancel", str(job["id"]), token="operator")
    assert r.exit_code == 0 and "cancelled" in r.stdout

    r = fleet.cli("cancel", str(job["id"]), token="operator")
    assert r.exit_code == EXIT_CONFLICT and r.stderr.startswith("error: 409: ")
    # A job that ended other than succeeded: `job --wait` says so and exits 1.
    r = fleet.cli("job", str(job["id"]), "--wait")
    assert r.exit_code == EXIT_FAILED and f"job {job['id']} cancelled" in r.stdout
    r = fleet.cli("jobs", "--watch", "--until-idle")
    assert r.exit_code == 0 and "cancelled" in r.stdout
