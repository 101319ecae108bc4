"""``switch --wait`` with a real agent: live step lines, exit 0 on success, and the inventory follows."""

from __future__ import annotations

import json
import subprocess

from gpumode.host.discover import discover

from .remote_support import Fleet, fleet, t4_agent

__all__ = ["fleet", "t4_agent"]


def test_switch_wait_follows_the_job_to_success(fleet: Fleet, t4_agent: subprocess.Popen[bytes]) -> None:
    r = fleet.cli(
        "switch", "t4-edge-02", "--mode", "accel", "--gpu", "0000:18:00.0", "--wait", token="operator"
    )
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("job ") and "t4-edge-02: accel on 1 GPU(s)" in lines[0]
    assert any(line.strip().startswith("✔") and "driver.install" in line for line in lines), r.stdout
    assert lines[-1].endswith("succeeded")
    assert t4_agent.poll() is None

    gpus = {g.address: g.mode.value for g in discover(fleet.hosts["t4-edge-02"]).gpus}
    assert gpus["0000:18:00.0"] == "accel"
    # Loading nvidia binds every T4 it finds, so the host's other GPUs may be accel too: the cards follow
    # the host, one accel card per GPU in accel.
    r = fleet.cli("cards", "--node", "t4-edge-02", "--json")
    cards = sorted((c["kind"], c["gpu"]) for c in json.loads(r.stdout))
    assert cards == sorted(("accel", a) for a, mode in gpus.items() if mode == "accel")
