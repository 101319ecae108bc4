"""``gpumode demo --exit-after`` runs the whole walkthrough with real agents, and what the server keeps at the
end matches the emulated hosts, checked here independently of the demo's own check."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from gpumode.cli.localserver import LocalServer
from gpumode.cli.main import app
from gpumode.host.discover import discover
from gpumode.host.root import Host

STAGES = (
    "1. control plane",
    "2. hosts",
    "3. agents join",
    "4. the whitelist",
    "5. dry run: hgx-h100-01 from accel to vGPU",
    "6. switch: hgx-h100-01 to vGPU",
    "7. a GPU is pulled from ws-cad-12",
    "8. final inventory",
)


@pytest.mark.slow
def test_demo_runs_to_the_end_and_the_inventory_matches_the_hosts(tmp_path: Path) -> None:
    where = tmp_path / "demo"
    result = CliRunner().invoke(app, ["demo", "--exit-after", "--dir", str(where)], catch_exceptions=False)
    out = result.stdout
    assert result.exit_code == 0, out
    positions = [out.find(stage) for stage in STAGES]
    assert -1 not in positions and positions == sorted(positions), out
    assert "refused 422" in out  # the whitelist stage: vGPU on the RTX 6000 is not allowed
    assert "job 1 succeeded" in out
    assert "the server's inventory matches all 3 hosts" in out
    assert not any(p.suffix == ".log" and "Traceback" in p.read_text() for p in (where / "logs").iterdir())

    # The demo is over; its database and hosts stay. A fresh server on that database must agree with them.
    hosts = {d.name: Host(d) for d in (where / "hosts").iterdir()}
    assert set(hosts) == {"hgx-h100", "l40s-sriov", "rtx-workstation"}
    server = LocalServer(where / "gpumode.db")
    admin = server.initialise().admin_token
    with server:
        api = httpx.Client(base_url=f"{server.url}/api/v1", headers={"Authorization": f"Bearer {admin}"})
        for host in hosts.values():
            snap = discover(host)
            node = api.get(f"/nodes/{snap.hostname}").json()
            assert node["fingerprint"] == snap.fingerprint
            assert sorted((g["address"], g["mode"]) for g in node["gpus"]) == sorted(
                (g.address, g.mode.value) for g in snap.gpus
            )
        hgx = discover(hosts["hgx-h100"])
        assert {g.mode.value for g in hgx.gpus} == {"vgpu"} and len(hgx.gpus) == 8
        vgpu_cards = api.get("/cards", params={"node": "hgx-h100-01"}).json()
        assert len(vgpu_cards) == 16 and {c["kind"] for c in vgpu_cards} == {"vgpu"}
        assert discover(hosts["rtx-workstation"]).gpus == []
        lost = api.get("/cards", params={"status": "lost"}).json()
        assert [(c["node"], c["holder"]) for c in lost] == [("ws-cad-12", "vm:win11-cad")]
        alarms = api.get("/events", params={"kind": "alarm.card_lost"}).json()
        assert [e["node"] for e in alarms] == ["ws-cad-12"]
        assert [j["state"] for j in api.get("/jobs").json()] == ["succeeded"]
        api.close()


def test_demo_refuses_a_used_directory(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("x")
    result = CliRunner().invoke(app, ["demo", "--exit-after", "--dir", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 1
    assert "is not an empty directory" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["something"]  # nothing was added


@pytest.mark.parametrize(
    "body",
    [
        {"mode": "vgpu", "vgpu_type": "NVIDIA H100XM-20C", "vgpu_count": 2, "vm_policy": "all"},
        {"mode": "accel", "vm_policy": "all"},
        {"mode": "vgpu"},
    ],
)
def test_the_commands_the_demo_prints_are_the_ones_it_runs(body: dict[str, object]) -> None:
    """Each printed ``gpumode switch`` line, parsed by the real CLI, sends the very body the demo sends."""
    import shlex

    import typer

    from gpumode.cli.demo import switch_command
    from gpumode.cli.remote_jobs import switch_body

    line = switch_command("hgx-h100-01", body, "--dry-run")
    argv = shlex.split(line)
    assert argv[:3] == ["gpumode", "switch", "hgx-h100-01"]
    command = typer.main.get_command(app).commands["switch"]  # type: ignore[attr-defined]
    params = command.make_context("switch", argv[2:]).params
    assert params["dry_run"] is True
    sent = switch_body(params["mode"], vgpu_type=params["vgpu_type"], count=params["count"],
                       vm_policy=params["vm_policy"])  # fmt: skip
    assert sent == {"gpus": [], "vm_policy": "gpu", **body}
