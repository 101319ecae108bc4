"""The versioned wire protocol (gpumode.wire): strict readers, and a server serving agents of this release
and of the previous one (protocol 1.0, gpumode 0.1.0) side by side: each gets the plan it can read, the node
list says which is out of date, and a job is never sent to an agent that cannot run its plan."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest

from gpumode import wire
from gpumode.agent.client import Client
from gpumode.domain import Impact, Step
from gpumode.modes.steps import default_registry
from gpumode.wire import Protocol, WireError

from .conftest import Api
from .test_jobs import PASSTHROUGH, switch


def test_readers_refuse_what_they_do_not_know() -> None:
    assert wire.agent_hello({}).protocol == Protocol(1, 0)  # 0.1.0 says nothing
    hello = wire.agent_hello({"X-Gpumode-Protocol": "1.1", "X-Gpumode-Version": "0.2.0",
                              "X-Gpumode-Actions": "bind.vfio,vm.shutdown"})  # fmt: skip
    assert hello.actions == {"bind.vfio", "vm.shutdown"} and not hello.out_of_date
    for raw, message in (("0.9", "not served here"), ("2.0", "not served here"), ("one", "not MAJOR.MINOR")):
        with pytest.raises(WireError, match=message):
            wire.agent_hello({"X-Gpumode-Protocol": raw})
    unknown = r"unsupported plan schema 'gpumode\.plan/v2'.*reads gpumode\.plan/v1"
    with pytest.raises(WireError, match=unknown):
        wire.read_plan({"schema": "gpumode.plan/v2", "steps": []})
    assert wire.read_plan({"steps": []}) == {"steps": []}  # a 0.1.0 server's plan: v1 without the key
    with pytest.raises(WireError, match="unsupported snapshot schema"):
        wire.check_schema("snapshot", {"schema": "gpumode.snapshot/v9"})


def test_the_previous_release_is_described_as_it_was() -> None:
    """What protocol 1.0 means must stay true of this code: every 0.1.0 action still runs, and 0.1.0's plan
    fields still exist (a newer field is what plan_for strips for a 1.0 agent)."""
    assert set(default_registry().actions()) >= wire.RELEASE_0_1_ACTIONS
    assert {f.name for f in dataclasses.fields(Step)} >= set(wire.RELEASE_0_1_STEP_KEYS)
    assert {f.name for f in dataclasses.fields(Impact)} >= set(wire.RELEASE_0_1_IMPACT_KEYS)
    plan = {"steps": [{"id": "a", "action": "vm.shutdown", "new_field": 1}], "impact": {"gpus": {}, "new": 2}}
    old = wire.plan_for(plan, Protocol(1, 0))
    assert old == {"steps": [{"id": "a", "action": "vm.shutdown"}], "impact": {"gpus": {}}}
    assert wire.plan_for(plan, Protocol(1, 1))["schema"] == wire.PLAN_SCHEMA


def _through(api: Api) -> httpx.MockTransport:
    """The agent's own HTTP client, talking to the app under test."""

    def handler(request: httpx.Request) -> httpx.Response:
        answer = api.client.request(request.method, request.url.path, params=request.url.params,
                                    headers=dict(request.headers), content=request.content)  # fmt: skip
        headers = {k: v for k, v in answer.headers.items() if k not in ("content-encoding", "content-length")}
        return httpx.Response(answer.status_code, headers=headers, content=answer.content)

    return httpx.MockTransport(handler)


def _agent(api: Api, token: str, protocol: Protocol) -> Client:
    return Client("http://testserver", token, transport=_through(api), protocol=protocol, max_backoff_s=0.05)


def _nodes(api: Api) -> dict[str, dict[str, Any]]:
    return {n["name"]: n for n in api.get("/nodes").json()}


def test_an_agent_pinned_to_the_previous_protocol_gets_the_plan_it_reads(api: Api) -> None:
    old_token, new_token = api.join("old-node"), api.join("new-node")
    assert _nodes(api)["old-node"]["agent_protocol"] is None  # not heard from yet
    for node in ("old-node", "new-node"):
        assert switch(api, node, PASSTHROUGH).status_code == 201
    old = _agent(api, old_token, Protocol(1, 0)).work("old-node", 0)
    new = _agent(api, new_token, wire.PROTOCOL).work("new-node", 0)
    assert old is not None and new is not None
    assert "schema" not in old["plan"]  # as a 0.1.0 server sent it
    assert all(set(s) <= set(wire.RELEASE_0_1_STEP_KEYS) for s in old["plan"]["steps"])
    assert set(old["plan"]["impact"]) <= set(wire.RELEASE_0_1_IMPACT_KEYS)
    assert [s["action"] for s in old["plan"]["steps"]] == [s["action"] for s in new["plan"]["steps"]]
    nodes = _nodes(api)
    assert (nodes["old-node"]["agent_protocol"], nodes["old-node"]["agent_version"]) == ("1.0", None)
    assert nodes["old-node"]["agent_out_of_date"] is True
    assert nodes["new-node"]["agent_protocol"] == str(wire.PROTOCOL)
    assert nodes["new-node"]["agent_version"] and nodes["new-node"]["agent_out_of_date"] is False


def test_a_job_is_never_sent_to_an_agent_that_cannot_run_its_plan(api: Api) -> None:
    token = api.join("n1")
    assert switch(api, "n1", PASSTHROUGH).status_code == 201
    plan = api.get("/jobs").json()[0]
    headers = {"Authorization": f"Bearer {token}", "X-Gpumode-Protocol": "1.1", "X-Gpumode-Version": "0.2.0",
               "X-Gpumode-Actions": "vm.shutdown"}  # an agent that lacks every other action  # fmt: skip
    r = api.client.get("/api/v1/nodes/n1/work", params={"wait": 0}, headers=headers)
    assert r.status_code == 204  # nothing was sent
    job = api.get(f"/jobs/{plan['id']}").json()
    assert job["state"] == "failed"
    assert "the agent on n1 (gpumode 0.2.0, protocol 1.1) cannot run" in job["error"]
    assert "bind.vfio" in job["error"] and "upgrade gpumode on n1" in job["error"]
    assert all(s["state"] == "pending" for s in job["steps"])


def test_an_agent_outside_the_served_range_is_told_to_upgrade(api: Api) -> None:
    token = api.join("n1")
    r = api.client.get("/api/v1/nodes/n1/work", params={"wait": 0},
                       headers={"Authorization": f"Bearer {token}", "X-Gpumode-Protocol": "0.9"})  # fmt: skip
    assert r.status_code == 426 and "accepts agents from 1.0" in r.json()["detail"]

