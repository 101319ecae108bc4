"""A PF's ``sriov.offset``/``sriov.stride`` through the API: validated, stored, and read back by the planner
(the dry run names the VFs an A16 will have); and a snapshot from an agent older than the fields, without
them, still accepted with the fingerprint that agent computed."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from gpumode.domain import Sriov
from gpumode.server.snapshot import SnapshotIn

from .builders import host
from .conftest import Api

A16 = 0x25B6
A16_SUBSYSTEM = 0x14A9  # the catalog tells the A16 from the A2 (same device id) by it
GPU = "0000:1b:00.0"
VGPU = {"mode": "vgpu", "vgpu_type": "NVIDIA A16-4Q", "vgpu_count": 2}


def a16_host(name: str, **sriov: Any) -> dict[str, Any]:
    """One A16 on the data-center driver, VFs off; ``sriov`` are the Sriov fields beyond the counts."""
    sriov_now = Sriov(total_vfs=16, num_vfs=0, **sriov)
    snap = host(name, 1, device=A16, changes={GPU: {"sriov": sriov_now, "subsystem_device": A16_SUBSYSTEM}})
    return snap.to_dict()


def old_agent_body(name: str) -> dict[str, Any]:
    """What an agent from before the fields sends: no such keys, its fingerprint over exactly that."""
    body = a16_host(name)
    for fn in body["functions"]:
        del fn["boot_vga"]  # added to v1 later still
        if fn["sriov"]:
            del fn["sriov"]["offset"], fn["sriov"]["stride"]
    body.pop("fingerprint")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["fingerprint"] = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    return body


def create_descriptions(api: Api, node: str) -> list[str]:
    r = api.call("POST", f"/nodes/{node}/switch", api.admin, json=VGPU, params={"dry_run": "true"})
    assert r.status_code == 200, r.text
    return [s["description"] for s in r.json()["plan"]["steps"] if s["action"] == "vgpu.create"]


def test_offset_and_stride_round_trip_through_the_api(api: Api) -> None:
    body = a16_host("n1", offset=4, stride=1)
    assert SnapshotIn.model_validate(body).to_domain().to_dict() == body
    token = api.join("n1", snapshot=a16_host("n1", offset=4, stride=1))
    assert create_descriptions(api, "n1") == [
        f"create a NVIDIA A16-4Q vGPU on VF 0 (0000:1b:00.4) of {GPU}",
        f"create a NVIDIA A16-4Q vGPU on VF 1 (0000:1b:00.5) of {GPU}",
    ]
    moved = a16_host("n1", offset=0x80, stride=2)  # a different layout is a different snapshot
    r = api.report("n1", token, moved)
    assert r.status_code == 200 and r.json()["changed"] and r.json()["fingerprint"] == moved["fingerprint"]
    assert create_descriptions(api, "n1")[1] == f"create a NVIDIA A16-4Q vGPU on VF 1 (0000:1b:10.2) of {GPU}"


def test_a_snapshot_from_an_older_agent_is_accepted_as_it_was_fingerprinted(api: Api) -> None:
    token = api.join("n1", snapshot=a16_host("n1", offset=4, stride=1))
    body = old_agent_body("n1")
    r = api.report("n1", token, body)
    assert r.status_code == 200, r.text
    assert r.json()["changed"] and r.json()["fingerprint"] == body["fingerprint"]
    assert api.report("n1", token, body).json()["changed"] is False  # the same report again: skipped
    # the host still finds virtfn<N> when the step runs; only the description cannot name the VF
    assert create_descriptions(api, "n1")[0] == f"create a NVIDIA A16-4Q vGPU on VF 0 of {GPU}"


# 4.5 is no integer; 4.0 is (JSON has one number type, and the OpenAPI document says "integer")
@pytest.mark.parametrize("bad", [{"offset": -1}, {"offset": "4"}, {"stride": 0x10000}, {"offset": 4.5}])
def test_bad_offset_or_stride_is_422_naming_the_field(api: Api, bad: dict[str, Any]) -> None:
    token = api.join("n1")
    body = a16_host("n1", offset=4, stride=1)
    body["functions"][0]["sriov"].update(bad)
    r = api.report("n1", token, body)
    assert r.status_code == 422, r.text
    assert next(iter(bad)) in json.dumps(r.json()["detail"])
