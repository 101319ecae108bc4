"""The agent whose node token is revoked (#16): it says so once, keeps the host as it is, retries instead of
exiting, and carries on when it is given a new token."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpumode.agent.credentials import read_status
from gpumode.host.discover import discover
from gpumode.host.root import Host

from .conftest import Agent, Server, emulated, wait_for

NODE = "t4-edge-02"  # the t4-mdev fixture's hostname


def _node_token_ids(server: Server) -> list[int]:
    return [t["id"] for t in server.get("/tokens") if t["node"] == NODE and not t["revoked"]]


@pytest.mark.slow  # two agent starts and a server: ~45 s
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_revoked_agent_waits_and_recovers_with_a_new_token(
    server: Server, agents: Callable[[Host], Agent], tmp_path: Path
) -> None:
    host = emulated("t4-mdev", tmp_path / "host")
    agent = agents(host)
    agent.start()
    wait_for(lambda: server.call("GET", f"/nodes/{NODE}").status_code == 200, 30, "the agent to join")
    wait_for(lambda: (read_status(host) or {}).get("state") == "ok", 10, "the agent's status to say ok")
    before = discover(host).fingerprint

    (token_id,) = _node_token_ids(server)
    assert server.call("DELETE", f"/tokens/{token_id}").status_code == 200
    status = wait_for(
        lambda: (s := read_status(host)) is not None and s["state"] == "token_refused" and s,
        20,
        "the refusal",
    )
    assert NODE in status["message"] and "gpumode token replace" in status["message"]
    time.sleep(2.0)  # several retries at --max-backoff 0.5
    assert agent.proc is not None and agent.proc.poll() is None, agent.output()[-3000:]
    assert agent.output().count("refused this node's token") == 1  # said once, not per retry
    assert discover(host).fingerprint == before  # the host is left as it is

    assert agent.stop() == 0  # a clean stop even while refused
    assert "Traceback" not in agent.output()

    # an admin lets the host take its node over again and hands it a join token: it is back
    assert server.call("POST", f"/nodes/{NODE}/replace").status_code == 200
    r = server.call("POST", "/join-tokens", json={"name": "again"})
    agent.token = r.json()["token"]
    agent.start()
    wait_for(lambda: len(_node_token_ids(server)) == 1, 30, "the agent to join again")
    wait_for(lambda: (read_status(host) or {}).get("state") == "ok", 20, "the agent's status to say ok again")
    assert "the server refuses the stored node token; joining" in agent.output()
    rejoined = server.get("/events", params={"kind": "node.rejoined"})
    assert len(rejoined) == 1 and "replacement allowed by root" in rejoined[0]["message"]
    assert agent.stop() == 0
    assert "Traceback" not in agent.output()
