"""Switch jobs with ``cloud = "openstack"``, end to end: a real ``gpumode server`` subprocess configured for
the in-process REAL Placement and the fake Nova, a real ``gpumode agent`` subprocess on an emulated T4 host,
the REST API driving it. nova-compute is a systemd unit on the emulated host (``systemctl restart
nova-compute`` answers as on a real host); :class:`NovaComputeWatch` plays the daemon: each time the unit
(re)starts, it reads the drop-in the agent delivered and reports to Placement as nova-compute does.

The agent's end-to-end helpers (``tests/agent/conftest.py``) are reused: pytest imports that directory as the
package ``agent``."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.conftest import GPUMODE, Agent, Server, emulated, wait_for
from gpumode.cloud.openstack.novaconf import HEADER
from gpumode.emulated.packages import UNIT_DIR
from gpumode.emulated.services import RUNTIME_DIR
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.server import db
from gpumode.server.auth import Role, create_user_token

from .reporter import NovaComputeReporter
from .services import FakeNova, Faults, PlacementAdmin, Served

log = logging.getLogger(__name__)

DROPIN = "/etc/nova/nova.conf.d/gpumode.conf"
UNIT = "nova-compute.service"
GPUS = ["0000:18:00.0", "0000:3b:00.0", "0000:99:00.0", "0000:b0:00.0"]
VGPU, PT, ACCEL = "CUSTOM_GPUMODE_VGPU", "CUSTOM_GPUMODE_PASSTHROUGH", "CUSTOM_GPUMODE_ACCEL"
ENDED = {"succeeded", "failed", "rolled_back", "cancelled"}
PLACEMENT_RETRY_S = 4  # how long a job's cloud steps wait for Placement before the host is rolled back


class NovaComputeWatch:
    """nova-compute's life on the emulated host: every new invocation of its unit reports to Placement."""

    def __init__(self, host: Host, reporter: NovaComputeReporter) -> None:
        self.link = host.path(RUNTIME_DIR, f"invocation:{UNIT}")
        self.reporter = reporter
        self.reports = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._seen = self._invocation()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _invocation(self) -> str | None:
        try:
            return os.readlink(self.link)
        except OSError:
            return None

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            current = self._invocation()
            if current is None or current == self._seen:
                continue
            self._seen = current
            try:
                self.reporter.restart()
                self.reports += 1
            except (AssertionError, OSError) as exc:  # Placement down: nova-compute logs and carries on
                self.failures.append(str(exc))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Cloud:
    server: Server
    agent: Agent
    host: Host
    name: str
    placement: PlacementAdmin
    nova: FakeNova
    faults: Faults
    watch: NovaComputeWatch

    def switch(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.server.call("POST", f"/nodes/{self.name}/switch", json=body)
        assert r.status_code == 201, r.text
        job: dict[str, Any] = r.json()
        return job

    def wait(self, job_id: int, timeout: float = 90) -> dict[str, Any]:
        return self.server.wait_job(job_id, ENDED, timeout)

    def provider(self, name: str) -> dict[str, Any]:
        return self.placement.providers()[name]

    def service(self) -> dict[str, Any]:
        return next(s for s in self.nova.services.values() if s["host"] == self.name)

    def placement_state(self) -> dict[str, Any]:
        """Every provider's traits, aggregates and inventory: what "Placement unchanged" compares."""
        p = self.placement
        return {
            n: (p.traits(rp["uuid"]), p.aggregates(rp["uuid"]), p.inventories(rp["uuid"]))
            for n, rp in p.providers().items()
        }


def vgpu_provider(name: str, gpu: str) -> str:
    return f"{name}_pci_" + gpu.replace(":", "_").replace(".", "_")


def server_config(path: Path, db_url: str, placement: PlacementAdmin, nova_url: str) -> Path:
    endpoint = str(placement.http.base_url).rstrip("/")
    path.write_text(
        f'[server]\ndb = "{db_url}"\ncloud = "openstack"\n\n'
        f'[openstack]\nauth_type = "noauth"\nplacement_endpoint = "{endpoint}"\n'
        f'compute_endpoint = "{nova_url}"\npci_in_placement = true\nnova_dropin = "{DROPIN}"\n'
        'restart_command = ["systemctl", "restart", "nova-compute"]\n'
        "inventory_timeout_s = 6\npoll_interval_s = 0.3\nvm_timeout_s = 5\n"
        f"placement_retry_s = {PLACEMENT_RETRY_S}\n"
    )
    return path


@pytest.fixture
def cloud(
    tmp_path: Path, placement: PlacementAdmin, faults: Faults, nova: tuple[FakeNova, Served]
) -> Iterator[Cloud]:
    fake, served = nova
    db_url = str(tmp_path / "gpumode.db")
    engine = db.make_engine(db_url)
    db.upgrade(engine)
    with db.make_sessionmaker(engine).begin() as session:
        _, admin = create_user_token(session, "root", Role.ADMIN, created_by="test")
    engine.dispose()
    config = server_config(tmp_path / "server.toml", db_url, placement, served.url)
    srv = OpenStackServer(db=db_url, log=tmp_path / "server.log", admin=admin, config=config)
    srv.start()

    host = emulated("t4-mdev", tmp_path / "host")
    unit = host.path(UNIT_DIR, UNIT)  # nova installed on the compute host: a unit systemctl knows
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text("[Unit]\nDescription=OpenStack Compute\n\n[Service]\nExecStart=/usr/bin/nova-compute\n")
    name = discover(host).hostname
    fake.add_service(name)
    watch = NovaComputeWatch(host, NovaComputeReporter(placement, host, DROPIN))
    agent = Agent(srv, host, srv.join_token(), tmp_path / "agent.log")
    agent.start()
    try:
        wait_for(lambda: srv.call("GET", f"/nodes/{name}").status_code == 200, 30, "the agent to join")
        yield Cloud(srv, agent, host, name, placement, fake, faults, watch)
    finally:
        watch.stop()
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(10)
        srv.kill()


@dataclass
class OpenStackServer(Server):
    config: Path | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*GPUMODE, "server", "--config", str(self.config), "--port", str(self.port)],
                stdout=out,
                stderr=out,
            )
        wait_for(self._healthy, 30, "the server to answer /healthz")


def explain(c: Cloud, job: dict[str, Any]) -> str:
    return f"{job['state']}: {job['error']}\n{c.agent.output()[-2500:]}\n{c.server.log.read_text()[-2500:]}"


def test_vgpu_then_passthrough_then_accel_through_the_api(cloud: Cloud) -> None:
    c, p = cloud, cloud.placement
    body = {"mode": "vgpu", "vgpu_type": "GRID T4-2Q", "vgpu_count": 2, "vm_policy": "all"}
    dry = c.server.call("POST", f"/nodes/{c.name}/switch", json=body, params={"dry_run": "true"})
    assert dry.status_code == 200, dry.text
    steps = dry.json()["plan"]["steps"]
    actions = [(s["action"], s["target"]) for s in steps]
    # the platform's host steps: a rollback guard first, the drop-in and the restart just before the cloud
    assert actions[0] == ("command.run", "nova-compute-rollback")
    assert actions[-4:] == [
        ("file.write", DROPIN),
        ("command.run", "nova-compute"),
        ("cloud.register_cards", c.name),
        ("cloud.deploy_env", c.name),
    ]
    assert "enabled_mdev_types = nvidia-" in steps[-4]["params"]["content"]
    assert steps[-3]["params"]["checkpoint"] is True

    job = c.switch(body)
    assert job["plan"] == dry.json()["plan"]  # what the dry run showed is what runs
    job = c.wait(job["id"])
    assert job["state"] == "succeeded", explain(c, job)
    dropin = c.host.path(DROPIN).read_text()
    assert f"device_addresses = {','.join(GPUS)}" in dropin
    root = c.provider(c.name)
    assert p.traits(root["uuid"]) == {VGPU}
    for gpu in GPUS:
        rp = c.provider(vgpu_provider(c.name, gpu))
        assert p.inventories(rp["uuid"])["VGPU"] >= 2 and p.traits(rp["uuid"]) == {VGPU}
    vgpu_agg = next(a for a in c.nova.aggregates.values() if a["name"] == "gpumode-vgpu")
    assert p.aggregates(root["uuid"]) == {vgpu_agg["uuid"]} and vgpu_agg["hosts"] == [c.name]
    assert c.service()["status"] == "enabled"
    register = next(s for s in job["steps"] if s["action"] == "cloud.register_cards")
    assert "nova-compute configured and restarted" in register["note"]

    # A VM holds a vGPU on the first GPU: an allocation in Placement, an instance in Nova.
    held = c.provider(vgpu_provider(c.name, GPUS[0]))
    consumer = str(uuid.uuid4())
    p.allocate(consumer, held["uuid"], {"VGPU": 1})
    vm = c.nova.add_server("vdi-1", c.name, {"resources:VGPU": "1"})
    bystander = c.nova.add_server("web-1", c.name, {})

    # Stopped, the VM still holds its vGPU: the GPU cannot leave vgpu (Placement would go on offering its
    # vGPUs), so the switch is refused after the host steps and the host rolled back, the allocation intact.
    job = c.wait(c.switch({"mode": "passthrough", "vm_policy": "gpu"})["id"])
    assert job["state"] == "rolled_back", explain(c, job)
    assert f"GPU {GPUS[0]} left vgpu but consumer(s) {consumer} still hold allocations" in job["error"]
    assert {g.mode.value for g in discover(c.host).gpus} == {"vgpu"}
    wait_for(lambda: p.traits(root["uuid"]) == {VGPU} or None, 10, "the vGPU marks to be put back")
    assert p.allocations(consumer)[held["uuid"]]["resources"] == {"VGPU": 1}
    assert vm.status == "ACTIVE"  # started again after the failed switch

    p.call("DELETE", f"/allocations/{consumer}")  # the VM is shelved: nova frees its allocation
    job = c.wait(c.switch({"mode": "passthrough", "vm_policy": "gpu"})["id"])
    assert job["state"] == "succeeded", explain(c, job)
    assert (vm.status, bystander.status) == ("SHUTOFF", "ACTIVE")  # stopped for the switch, left stopped
    disabled = [b for m, path, b in c.nova.requests if m == "PUT" and path.startswith("/os-services/")]
    assert {"status": "disabled", "disabled_reason": f"gpumode job {job['id']}: GPU mode switch"} in disabled
    assert c.service()["status"] == "enabled"
    assert p.traits(root["uuid"]) == {PT}
    for gpu in GPUS:
        rp = c.provider(f"{c.name}_{gpu.upper()}")  # nova's name
        assert p.inventories(rp["uuid"]) == {"CUSTOM_PCI_10DE_1EB8": 1} and p.traits(rp["uuid"]) == {PT}
    assert {n for n in p.providers() if n.startswith(c.name + "_pci_")} == set()  # no VGPU left anywhere

    job = c.wait(c.switch({"mode": "accel", "vm_policy": "gpu"})["id"])
    assert job["state"] == "succeeded", explain(c, job)
    assert c.host.path(DROPIN).read_text() == HEADER + "\n[pci]\nreport_in_placement = True\n"
    assert p.traits(root["uuid"]) == {ACCEL}
    accel_agg = next(a for a in c.nova.aggregates.values() if a["name"] == "gpumode-accel")
    assert p.aggregates(root["uuid"]) == {accel_agg["uuid"]}
    assert {n for n in p.providers() if n.startswith(c.name + "_")} == set()
    assert c.service()["status"] == "enabled" and c.watch.failures == []


def test_placement_stopped_mid_switch_rolls_the_job_back(cloud: Cloud) -> None:
    c = cloud
    job = c.wait(c.switch({"mode": "vgpu", "vgpu_type": "GRID T4-2Q", "vgpu_count": 2})["id"])
    assert job["state"] == "succeeded", explain(c, job)
    vgpu_dropin = c.host.path(DROPIN).read_text()
    before = c.placement_state()
    vm = c.nova.add_server("vdi-1", c.name, {"resources:VGPU": "1"})

    def down_once_the_new_dropin_is_there(method: str, path: str) -> bool:
        try:
            return "device_spec" in c.host.path(DROPIN).read_text()
        except OSError:
            return False

    c.faults.fail = down_once_the_new_dropin_is_there
    job = c.wait(c.switch({"mode": "passthrough", "vm_policy": "gpu"})["id"])
    c.faults.fail = None
    assert job["state"] == "rolled_back", explain(c, job)
    assert "the cloud platform failed mid-switch" in job["error"]
    assert "HTTP 503" in job["error"] and "the host was rolled back" in job["error"]
    host_steps = [s for s in job["steps"] if s["where"] == "host"]
    assert {s["state"] for s in host_steps} <= {"undone", "skipped", "pending"}
    assert {s["state"] for s in job["steps"] if s["where"] == "cloud"} == {"pending"}
    # the host, its nova configuration and Placement are as they were; Nova got its host and VM back
    assert {g.mode.value for g in discover(c.host).gpus} == {"vgpu"}
    assert c.host.path(DROPIN).read_text() == vgpu_dropin
    deadline = time.monotonic() + 10
    while (now := c.placement_state()) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert now == before, placement_difference(c, before, now)  # nova-compute reported the old inventory
    assert c.service()["status"] == "enabled" and vm.status == "ACTIVE"


def placement_difference(c: Cloud, before: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs, and what the nova-compute stand-in did: enough to tell a race from a wrong result."""
    names = before.keys() | now.keys()
    changed = {n: (before.get(n), now.get(n)) for n in names if before.get(n) != now.get(n)}
    reporter = c.watch.reporter
    return (
        f"Placement differs (provider: before, now): {changed}\n"
        f"nova-compute reports {c.watch.reports}, failures {c.watch.failures}, "
        f"skipped {reporter.skipped}, kept {reporter.kept}\n{c.server.log.read_text()[-2000:]}"
    )


def test_placement_away_before_the_start_makes_the_job_wait_then_fail(cloud: Cloud) -> None:
    c = cloud
    c.faults.fail = lambda method, path: True
    job = c.switch({"mode": "passthrough"})

    def waiting() -> dict[str, Any] | None:
        seen = c.server.job(job["id"])
        return seen if seen["error"] and seen["state"] == "queued" else None

    seen = wait_for(waiting, 20, "the job to say it waits")
    assert "waiting for the cloud platform before starting" in seen["error"] and "503" in seen["error"]
    ended = c.wait(job["id"], 30)
    c.faults.fail = None
    assert ended["state"] == "failed", explain(c, ended)
    assert "gave up after waiting" in ended["error"] and "nothing was changed" in ended["error"]
    assert {s["state"] for s in ended["steps"]} == {"pending"}
    assert not c.host.path(DROPIN).exists() and c.service()["status"] == "enabled"
    assert not any(m == "PUT" and path.startswith("/os-services/") for m, path, _ in c.nova.requests)
