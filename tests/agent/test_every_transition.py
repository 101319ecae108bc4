"""Every transition end to end over real HTTP: a ``gpumode server`` and a ``gpumode agent`` on an emulated
host with two T4s (accel, vGPU and passthrough all allowed), switched through each ordered pair of modes by
``POST /nodes/{n}/switch``, on SQLite and on PostgreSQL.

After every job the server must show what the host shows: its GPUs equal ``gpumode discover --json`` run on
the host, and its cards are one per GPU in accel and passthrough, one per vGPU in vgpu, none for a GPU in
``none``, each naming a device that exists on the host with the mode's driver. ``none`` cannot be asked for
(the API refuses it), so it is only ever left: from the fresh host, and from a reboot, GPU by GPU.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpumode.emulated.fixtures.mini import T4, mini_host
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.host.root import Host

from .conftest import GPUMODE, Agent, Server, emulated, wait_for

AgentFactory = Callable[[Host], Agent]
SPEC = mini_host("none", T4, gpus=2)  # the cheapest host whose GPUs allow all three modes
NODE = SPEC.hostname
VGPUS_PER_GPU = 2
OPTIONS = {"vgpu": {"vgpu_type": "GRID T4-2Q", "vgpu_count": VGPUS_PER_GPU}}
# each ordered pair of accel, vgpu, passthrough once, from none to accel at the start
CIRCUIT = ("accel", "vgpu", "passthrough", "accel", "passthrough", "vgpu", "accel")
DRIVER = {"accel": "nvidia", "vgpu": "nvidia", "passthrough": "vfio-pci"}
EVERY_EDGE = {(a, b) for a, b in itertools.permutations(("accel", "vgpu", "passthrough"), 2)} | {
    ("none", m) for m in DRIVER
}


def host_view(host: Host) -> dict[str, Any]:
    """``gpumode discover --json`` on the host, as an operator would run it."""
    out = subprocess.run(
        [*GPUMODE, "discover", "--root", str(host.root), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    view: dict[str, Any] = json.loads(out.stdout)
    return view


def as_served(gpu: dict[str, Any]) -> dict[str, Any]:
    """A discovered GPU as the API spells it (PCI device id in hex)."""
    return {**gpu, "device": f"{gpu['device']:04x}"}


def driver_of(host: Host, address: str) -> str | None:
    link = host.path("sys/bus/pci/devices", address, "driver")
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def check_server_matches_host(server: Server, host: Host, expected: dict[str, str], what: str) -> None:
    """The inventory and the cards the server holds are what the host shows, and the host is ``expected``."""
    view = host_view(host)
    assert {g["address"]: g["mode"] for g in view["gpus"]} == expected, what

    node = server.get(f"/nodes/{NODE}")
    assert node["fingerprint"] == view["fingerprint"], what
    served = {g["address"]: g for g in node["gpus"]}
    assert served.keys() == expected.keys(), what
    for gpu in view["gpus"]:
        mine = as_served(gpu)
        assert served[gpu["address"]] == {k: mine[k] for k in served[gpu["address"]]}, what
    if len(set(expected.values())) == 1:
        assert node["mode"] == next(iter(expected.values())), what

    cards = server.get("/cards", params={"node": NODE})
    assert cards == node["cards"], what
    assert {(c["status"], c["holder"]) for c in cards} <= {("free", None)}, what
    for address, mode in expected.items():
        mine = sorted((c for c in cards if c["gpu"] == address), key=lambda c: c["device"])
        assert {c["kind"] for c in mine} <= {mode}, f"{what}: {address} in {mode} has {mine}"
        if mode == "none":
            assert mine == [], f"{what}: {address} has no driver, yet cards {mine}"
            continue
        assert driver_of(host, address) == DRIVER[mode], what
        if mode == "vgpu":  # one card per vGPU, each an mdev of this GPU
            assert len(mine) == VGPUS_PER_GPU, f"{what}: {address}: {mine}"
            gpu_dir = host.path("sys/bus/pci/devices", address).resolve()
            for card in mine:
                mdev = host.path("sys/bus/mdev/devices", card["device"])
                assert mdev.is_symlink() and mdev.resolve().parent == gpu_dir, f"{what}: {card}"
        else:  # one card per GPU, naming the GPU itself
            assert [c["device"] for c in mine] == [address], f"{what}: {mine}"
    assert {c["gpu"] for c in cards} <= expected.keys(), what


def switch(server: Server, agent: Agent, mode: str, gpus: list[str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"mode": mode, **OPTIONS.get(mode, {})}
    if gpus:
        body["gpus"] = gpus
    r = server.call("POST", f"/nodes/{NODE}/switch", json=body)
    assert r.status_code == 201, r.text
    job = server.wait_job(r.json()["id"], {"succeeded", "failed", "rolled_back"})
    assert job["state"] == "succeeded", (mode, gpus, job["error"], agent.output()[-3000:])
    assert {s["state"] for s in job["steps"] if s["where"] == "host"} <= {"done", "skipped"}
    assert {s["state"] for s in job["steps"] if s["where"] == "cloud"} <= {"done", "skipped"}
    return job


@pytest.mark.slow  # 9 switches over HTTP, two agent starts: 8–11 s per database when the machine is idle
def test_every_transition_over_http(server: Server, agents: AgentFactory, tmp_path: Path) -> None:
    started = time.monotonic()
    host = emulated(SPEC, tmp_path / "host", key="mini-t4-none-2")
    agent = agents(host)
    agent.start()
    wait_for(lambda: server.call("GET", f"/nodes/{NODE}").status_code == 200, 30, "the agent to join")
    expected = {g["address"]: g["mode"] for g in host_view(host)["gpus"]}
    assert set(expected.values()) == {"none"} and len(expected) == 2
    check_server_matches_host(server, host, expected, "joined")
    edges: set[tuple[str, str]] = set()

    def walk(mode: str, gpus: list[str] | None = None) -> None:
        chosen = gpus or list(expected)
        came_from = {expected[g] for g in chosen}
        switch(server, agent, mode, gpus)
        edges.update((before, mode) for before in came_from)
        expected.update(dict.fromkeys(chosen, mode))
        check_server_matches_host(server, host, expected, f"{sorted(came_from)} → {mode} on {chosen}")

    for mode in CIRCUIT:
        walk(mode)

    # a power cycle: every GPU back to none; the agent must not put the desired mode back this time
    assert agent.stop() == 0
    EmulatedKernel(host.root).reboot()
    agent.start(options=["--no-desired"])
    expected = dict.fromkeys(expected, "none")
    fresh = host_view(host)["fingerprint"]
    wait_for(lambda: server.get(f"/nodes/{NODE}")["fingerprint"] == fresh, 30, "the rebooted host's report")
    first, second = sorted(expected)
    walk("passthrough", [first])  # vfio-pci leaves the other GPU without a driver
    walk("vgpu", [second])  # and then it meets the vGPU manager, next to a passthrough GPU

    assert edges >= EVERY_EDGE, sorted(EVERY_EDGE - edges)
    assert agent.stop() == 0
    print(f"\nevery transition over HTTP: {time.monotonic() - started:.1f}s")
