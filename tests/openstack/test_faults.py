"""Placement failing mid-switch: gpumode waits with a clear message, or puts back what it wrote (and, in a
switch job, the host too)."""

from __future__ import annotations

import json
import re
import socket
from typing import Any

import pytest

from agent.conftest import wait_for
from gpumode.cloud.base import CloudUnavailable
from gpumode.cloud.openstack.factory import build_clients
from gpumode.cloud.openstack.http import OpenStackError
from gpumode.cloud.openstack.platform import OpenStackPlatform
from gpumode.domain import Mode
from gpumode.host.discover import discover

from .conftest import RESTART, Stack
from .services import Faults
from .test_jobs_openstack import DROPIN, VGPU, Cloud, explain
from .test_jobs_openstack import cloud as _cloud  # noqa: F401  (the fixture ``job_cloud`` stands on)


def marks(stack: Stack) -> dict[str, tuple[set[str], set[str]]]:
    """gpumode's marks on every provider: its traits (nova's own are nova's) and the aggregates."""
    p = stack.placement
    return {
        n: ({t for t in p.traits(rp["uuid"]) if t.startswith("CUSTOM_GPUMODE_")}, p.aggregates(rp["uuid"]))
        for n, rp in p.providers().items()
    }


@pytest.mark.nova
def test_trait_write_failing_midway_puts_back_every_mark(real_stack: Stack, faults: Faults) -> None:
    stack = real_stack
    stack.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    stack.platform.set_up_cards(discover(stack.host))
    before = marks(stack)
    aggregates_before = {a["name"]: list(a["hosts"]) for a in stack.nova.aggregates.values()}
    stack.switch(Mode.PASSTHROUGH)

    puts: list[str] = []

    def third_trait_put_fails(method: str, path: str) -> bool:
        if method == "PUT" and path.endswith("/traits") and path.startswith("/resource_providers/"):
            puts.append(path)
            return len(puts) == 3
        return False

    faults.fail = third_trait_put_fails
    faults.spare_harness = True  # gpumode's writes fail; nova-compute's own trait writes go through
    with pytest.raises(OpenStackError, match=r"marking GPU modes in Placement failed.*put back"):
        stack.platform.set_up_cards(discover(stack.host))
    faults.fail = None
    # Inventory is nova-compute's own report; gpumode's marks are exactly as before, on every provider
    after = marks(stack)
    assert {n: after[n] for n in before if n in after} == {n: before[n] for n in before if n in after}
    assert all(m == (set(), set()) for n, m in after.items() if n not in before)
    assert {a["name"]: a["hosts"] for a in stack.nova.aggregates.values()} == aggregates_before

    stack.platform.set_up_cards(discover(stack.host))  # Placement is back: the retry completes
    assert marks(stack)[stack.name][0] == {"CUSTOM_GPUMODE_PASSTHROUGH"}


@pytest.mark.nova
def test_placement_down_while_waiting_times_out_clearly_and_writes_nothing(
    real_stack: Stack, faults: Faults
) -> None:
    stack = real_stack
    stack.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    stack.platform.set_up_cards(discover(stack.host))
    before = marks(stack)
    stack.switch(Mode.ACCEL)
    faults.fail = lambda method, path: True
    with pytest.raises(OpenStackError) as err:
        stack.platform.set_up_cards(discover(stack.host))
    message = str(err.value)
    assert "timed out after 5s waiting for Placement to show" in message
    assert "unreachable" in message or "HTTP 503" in message
    faults.fail = None
    assert marks(stack) == before
    # nova-compute started, logged that it could not report, and goes on (its next periodic update retries)
    assert any("Error updating resources for node" in w for w in stack.real.warnings), stack.real.warnings


def test_inventory_never_appearing_times_out_naming_the_provider(stack: Stack) -> None:
    stack.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    stack.reporter.restart = lambda: None  # type: ignore[method-assign]
    stack.placement.call("POST", "/resource_providers", {"name": stack.name})
    with pytest.raises(OpenStackError, match=r"_pci_0000_18_00_0 absent"):
        stack.platform.set_up_cards(discover(stack.host))
    root = stack.provider(stack.name)
    assert stack.placement.traits(root["uuid"]) == set()


def test_failed_restart_stops_before_placement(stack: Stack, faults: Faults) -> None:
    stack.switch(Mode.PASSTHROUGH)
    stack.channel.broken_restart = True
    faults.seen.clear()
    with pytest.raises(OpenStackError, match=r"restarting nova-compute on .* failed \(exit 1\): Job for"):
        stack.platform.set_up_cards(discover(stack.host))
    assert faults.seen == []  # not one request to Placement
    assert stack.placement.providers() == {}


@pytest.mark.nova
def test_one_try_says_what_it_waits_for_and_tells_transient_from_permanent(
    real_stack: Stack, faults: Faults
) -> None:
    """``set_up_cards(wait=False)``, as a job's cloud step calls it: connection refused, 409 and 5xx may pass
    (``CloudUnavailable``, naming Placement's URL); a 4xx will not. Either way nothing stays written."""
    stack = real_stack
    stack.switch(Mode.PASSTHROUGH)
    stack.platform.set_up_cards(discover(stack.host))
    stack.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    snap = discover(stack.host)
    # what a job's host steps do: the new drop-in, nova-compute restarted (it reports the new inventory)
    stack.channel.write_file(stack.name, stack.config.nova_dropin, stack.platform.render(snap))
    stack.channel.run(stack.name, RESTART)
    before = marks(stack)

    with socket.socket() as sock:  # a port nothing listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = stack.config.model_copy(update={"placement_endpoint": dead})
    away = OpenStackPlatform(stack.session, config, build_clients(config, stack.channel))
    with pytest.raises(
        CloudUnavailable, match=rf"waiting for Placement at {dead} .*unreachable \(connection refused\)$"
    ):
        away.set_up_cards(snap, delivered=True, wait=False)

    def trait_write(method: str, path: str) -> bool:
        return method == "PUT" and re.fullmatch(r"/resource_providers/[^/]+/traits", path) is not None

    faults.fail = trait_write
    for status in (409, 500, 503):
        faults.status = status
        with pytest.raises(CloudUnavailable, match=rf"waiting for Placement at .*HTTP {status}.*put back"):
            stack.platform.set_up_cards(snap, delivered=True, wait=False)
    faults.status = 400
    with pytest.raises(OpenStackError, match=r"HTTP 400") as err:
        stack.platform.set_up_cards(snap, delivered=True, wait=False)
    assert not isinstance(err.value, CloudUnavailable)
    assert marks(stack) == before
    faults.fail = None
    assert "traits/aggregates updated" in stack.platform.set_up_cards(snap, delivered=True, wait=False)
    root_traits = stack.placement.traits(stack.provider(stack.name)["uuid"])
    assert {t for t in root_traits if t.startswith("CUSTOM_GPUMODE_")} == {"CUSTOM_GPUMODE_VGPU"}


# --- in switch jobs: Placement failing after the agent's run ended ------------------------------------------
# A real server and agent (``cloud`` from test_jobs_openstack); the faults spare nova-compute's (the
# reporter's) requests, so only gpumode's fail; the server gives Placement PLACEMENT_RETRY_S seconds.


@pytest.fixture
def job_cloud(request: pytest.FixtureRequest) -> Cloud:
    found: Cloud = request.getfixturevalue("_cloud")
    return found


def register_step(job: dict[str, Any]) -> dict[str, Any]:
    step: dict[str, Any] = next(s for s in job["steps"] if s["action"] == "cloud.register_cards")
    return step


def test_placement_away_after_the_host_steps_the_job_waits_and_succeeds(job_cloud: Cloud) -> None:
    c = job_cloud
    c.faults.spare_harness = True
    c.faults.fail = lambda method, path: path.startswith("/resource_providers")  # not the /traits probe
    job = c.switch({"mode": "vgpu", "vgpu_type": "GRID T4-2Q", "vgpu_count": 2})

    def waiting_again() -> dict[str, Any] | None:
        seen = c.server.job(job["id"])
        note = register_step(seen)["note"] or ""
        return seen if "attempt 2," in note else None

    seen = wait_for(waiting_again, 30, "the cloud step to say it waits for Placement")
    note = register_step(seen)["note"]
    url = str(c.placement.http.base_url).rstrip("/")
    assert f"waiting for Placement at {url}" in note and "HTTP 503" in note, note
    assert "retrying for" in note and register_step(seen)["state"] == "running"
    assert seen["state"] == "running" and seen["host_state"] == "done"
    assert seen["error"].startswith("waiting for the cloud platform after the host steps"), seen["error"]
    c.faults.fail = None  # Placement is back within the deadline

    job = c.wait(job["id"])
    assert job["state"] == "succeeded", explain(c, job)
    assert job["error"] is None and register_step(job)["state"] == "done"
    assert job["cloud"]["attempts"] >= 2
    root = c.provider(c.name)
    assert c.placement.traits(root["uuid"]) == {VGPU}
    assert {g.mode.value for g in discover(c.host).gpus} == {"vgpu"}


def test_placement_failing_the_trait_writes_until_the_deadline_rolls_the_host_back(job_cloud: Cloud) -> None:
    c = job_cloud
    job = c.wait(c.switch({"mode": "vgpu", "vgpu_type": "GRID T4-2Q", "vgpu_count": 2})["id"])
    assert job["state"] == "succeeded", explain(c, job)
    vgpu_dropin = c.host.path(DROPIN).read_text()
    before = c.placement_state()
    nova_before = {a["name"]: list(a["hosts"]) for a in c.nova.aggregates.values()}
    desired_before = c.host.path("etc/gpumode/desired.json").read_text()

    assert c.agent.proc is not None
    c.agent.proc.kill()
    c.agent.proc.wait(10)
    c.agent.start(env={"GPUMODE_FAULT_KILL": "undo:14"})  # this agent dies halfway through undoing the run
    c.faults.spare_harness, c.faults.status = True, 500
    c.faults.fail = lambda method, path: (
        method == "PUT" and re.fullmatch(r"/resource_providers/[^/]+/traits", path) is not None
    )
    job = c.switch({"mode": "passthrough", "vm_policy": "gpu"})

    def undoing() -> dict[str, Any] | None:
        seen = c.server.job(job["id"])
        return seen if seen["cancel_requested"] or seen["state"] not in ("queued", "running") else None

    seen = wait_for(undoing, 30, "the server to give up on Placement")
    c.faults.fail = None  # the deadline passed: Placement answers again while the host goes back
    assert "rolling the host back" in (seen["error"] or ""), seen
    assert c.agent.wait_exit(60) == -9
    halfway = c.server.job(job["id"])
    assert halfway["state"] == "running" and "undone" in {s["state"] for s in halfway["steps"]}
    assert {g.mode.value for g in discover(c.host).gpus} != {"vgpu"}
    c.server.kill()  # and the server dies too: both sides come back and finish from what they stored
    c.agent.start()  # its next start finishes the undo from the reopened journal
    c.server.start()
    job = c.wait(job["id"], 60)
    assert job["state"] == "rolled_back", explain(c, job)
    error = job["error"]
    assert "cloud step" in error and "failed after the host steps" in error, error
    assert "Placement" in error and "HTTP 500" in error and "the host was rolled back" in error, error
    assert register_step(job)["state"] == "failed"
    host_steps = [s for s in job["steps"] if s["where"] == "host"]
    assert {s["state"] for s in host_steps} <= {"undone", "skipped"} and "undone" in {
        s["state"] for s in host_steps
    }

    # the host is in its previous mode, with its previous nova configuration and desired state
    assert {g.mode.value for g in discover(c.host).gpus} == {"vgpu"}
    assert c.host.path(DROPIN).read_text() == vgpu_dropin
    assert (
        json.loads(c.host.path("etc/gpumode/desired.json").read_text())["gpus"]
        == json.loads(desired_before)["gpus"]
    )
    # Placement's traits, aggregates and inventory are as before; Nova's aggregates and service too
    wait_for(lambda: c.placement_state() == before, 10, "Placement to show the host as before")
    assert {a["name"]: a["hosts"] for a in c.nova.aggregates.values()} == nova_before
    assert c.service()["status"] == "enabled" and c.watch.failures == []
