"""Operator verbs against a real server: host groups, a lost card released, a card given a holder, vGPU
profiles and passthrough aliases — what the demo's lost-card alarm and rollouts needed curl for."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner, Result

from gpumode.cli.client import EXIT_BAD_INPUT, EXIT_CONFLICT, EXIT_FAILED
from gpumode.cli.localserver import LocalServer
from gpumode.cli.main import app
from gpumode.emulated.create import create_host
from gpumode.emulated.hypervisor import EmulatedHypervisor
from gpumode.host.discover import discover
from gpumode.host.root import Host

from .remote_support import CLEAN_ENV


class Site:
    def __init__(self, server: LocalServer, admin: str, join: str, home: Path) -> None:
        self.server, self.admin, self.join, self.home = server, admin, join, home
        self.node_tokens: dict[str, str] = {}

    def cli(self, *args: str) -> Result:
        env = {**CLEAN_ENV, "HOME": str(self.home), "GPUMODE_SERVER": self.server.url}
        env["GPUMODE_TOKEN"] = self.admin
        return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)

    def report(self, host: Host) -> None:
        snapshot = discover(host)
        api = f"{self.server.url}/api/v1"
        if snapshot.hostname not in self.node_tokens:  # the first report is the join
            body = {"hostname": snapshot.hostname, "snapshot": snapshot.to_dict()}
            r = httpx.post(f"{api}/agents/join", headers={"Authorization": f"Bearer {self.join}"}, json=body)
            assert r.status_code == 201, r.text
            self.node_tokens[snapshot.hostname] = r.json()["token"]
        node = {"Authorization": f"Bearer {self.node_tokens[snapshot.hostname]}"}
        r = httpx.post(f"{api}/nodes/{snapshot.hostname}/report", headers=node, json=snapshot.to_dict())
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    base = tmp_path_factory.mktemp("fleet-admin")
    server = LocalServer(base / "gpumode.db")
    creds = server.initialise()
    server.start()
    (base / "home").mkdir()
    try:
        yield Site(server, creds.admin_token, creds.join_token, base / "home")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def workstation(site: Site, tmp_path_factory: pytest.TempPathFactory) -> Host:
    host = create_host("rtx-workstation", tmp_path_factory.mktemp("ws"))  # ws-cad-12, 1 GPU passed through
    site.report(host)
    return host


def test_host_groups(site: Site, workstation: Host) -> None:
    assert site.cli("groups").stdout.strip() == "no host groups"
    made = site.cli("group", "create", "rack-a")
    assert made.exit_code == 0 and "host group rack-a created: no nodes yet" in made.stdout
    again = site.cli("group", "create", "rack-a")
    assert again.exit_code == EXIT_CONFLICT and "gpumode group assign rack-a" in again.output
    assigned = site.cli("group", "assign", "rack-a", "ws-cad-12")
    assert assigned.exit_code == 0 and "host group rack-a: ws-cad-12" in assigned.stdout
    assert json.loads(site.cli("groups", "--json").stdout) == [{"name": "rack-a", "nodes": ["ws-cad-12"]}]
    assert json.loads(site.cli("nodes", "--group", "rack-a", "--json").stdout)[0]["name"] == "ws-cad-12"
    unknown = site.cli("group", "assign", "rack-a", "nope")
    assert unknown.exit_code == EXIT_BAD_INPUT and "unknown node(s): nope" in unknown.output
    missing = site.cli("group", "assign", "rack-z", "ws-cad-12")
    assert missing.exit_code == EXIT_FAILED and "gpumode group create rack-z" in missing.output
    stranger = site.cli("group", "remove", "rack-a", "t4-edge-02")
    assert stranger.exit_code == EXIT_BAD_INPUT and "not in host group rack-a: t4-edge-02" in stranger.output
    removed = site.cli("group", "remove", "rack-a", "ws-cad-12")
    assert removed.exit_code == 0 and "host group rack-a: no nodes" in removed.stdout
    assert site.cli("group", "delete", "rack-a").exit_code == 0
    assert site.cli("groups").stdout.strip() == "no host groups"


def test_a_lost_card_is_released(site: Site, workstation: Host) -> None:
    cards = json.loads(site.cli("cards", "--json").stdout)
    [card] = [c for c in cards if c["node"] == "ws-cad-12"]
    held = site.cli("card", "assign", str(card["id"]), "--holder", "win11-cad")
    assert held.exit_code == 0 and f"card {card['id']} is in_use, held by win11-cad" in held.stdout
    # the VM is shut off and the GPU drops off the bus; the next report makes its held card lost
    EmulatedHypervisor(workstation).shutdown("win11-cad")
    workstation.write(workstation.path("sys/bus/pci/devices", card["gpu"], "remove"), "1")
    site.report(workstation)
    lost = json.loads(site.cli("cards", "--status", "lost", "--json").stdout)
    assert [c["id"] for c in lost] == [card["id"]]
    refused = site.cli("card", "assign", str(card["id"]), "--holder", "other-vm")
    assert refused.exit_code == EXIT_CONFLICT and "it can only be released" in refused.output
    released = site.cli("card", "release", str(card["id"]))
    assert released.exit_code == 0, released.output
    assert f"lost card {card['id']} (ws-cad-12 {card['device']}) released and removed" in released.stdout
    assert json.loads(site.cli("cards", "--status", "lost", "--json").stdout) == []
    events = json.loads(site.cli("events", "--kind", "card.released", "--json").stdout)
    assert len(events) == 1
    gone = site.cli("card", "release", str(card["id"]))
    assert gone.exit_code == EXIT_FAILED and "no card with id" in gone.output


def test_profiles_and_aliases(site: Site) -> None:
    assert site.cli("profiles").stdout.strip() == "no vGPU profiles"
    made = site.cli("profile", "set", "small", "--vgpu-type", "L40S-4Q", "--count", "4", "--description=VDI")
    assert made.exit_code == 0 and "vGPU profile small: 4 × L40S-4Q per GPU" in made.stdout
    assert json.loads(site.cli("profiles", "--json").stdout) == [
        {"name": "small", "vgpu_type": "L40S-4Q", "count_per_gpu": 4, "description": "VDI"}
    ]
    assert "L40S-4Q" in site.cli("profiles").stdout
    bad = site.cli("profile", "set", "huge", "--vgpu-type", "L40S-4Q", "--count", "0")
    assert bad.exit_code == EXIT_BAD_INPUT and "count_per_gpu" in bad.output
    assert site.cli("profile", "delete", "small").exit_code == 0
    assert site.cli("profile", "delete", "small").exit_code == EXIT_FAILED

    alias = site.cli("alias", "set", "h100", "--device", "2330", "--description", "H100 SXM5")
    assert alias.exit_code == 0 and "passthrough alias h100: 10de:2330" in alias.stdout
    assert "10de:2330" in site.cli("aliases").stdout
    bad_id = site.cli("alias", "set", "x", "--device", "zz")
    assert bad_id.exit_code == EXIT_BAD_INPUT
    assert site.cli("alias", "delete", "h100").exit_code == 0
    assert site.cli("aliases").stdout.strip() == "no passthrough aliases"
