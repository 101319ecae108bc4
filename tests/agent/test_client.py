"""The agent's client: retries with backoff while the server is away, gives up at once when told to stop,
never retries a refusal; and the stored node token is private to its owner."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import httpx
import pytest

from gpumode.agent import config
from gpumode.agent.client import ApiError, Client, Stopped
from gpumode.host.root import Host


def test_retries_until_the_server_answers() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            return httpx.Response(503, json={"detail": "restarting"})
        assert request.headers["authorization"] == "Bearer gpmn_x"
        return httpx.Response(200, json={"job": 1, "state": "running", "cancel_requested": True})

    client = Client("http://server", "gpmn_x", max_backoff_s=0.05, transport=httpx.MockTransport(handler))
    assert client.job_events(1, {"steps": []})["cancel_requested"] is True
    assert len(calls) == 3


def test_refusals_are_not_retried() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(403, json={"detail": "this node token belongs to a, not b"})

    client = Client("http://server", "gpmn_x", transport=httpx.MockTransport(handler))
    with pytest.raises(ApiError, match="HTTP 403: this node token belongs to a") as info:
        client.work("b", 1)
    assert info.value.status == 403 and len(calls) == 1


def test_stop_ends_the_backoff() -> None:
    stop = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        stop.set()  # the agent is told to stop while the server is away
        raise httpx.ConnectError("refused", request=request)

    client = Client("http://server", "t", stop=stop, max_backoff_s=10, transport=httpx.MockTransport(handler))
    with pytest.raises(Stopped):
        client.report("n", b"{}")


def test_node_token_is_stored_private(tmp_path: Path) -> None:
    host = Host(tmp_path)
    path = config.save(host, config.AgentConfig("http://s", "n1", "gpmn_secret"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert config.load(host) == config.AgentConfig("http://s", "n1", "gpmn_secret")
    path.write_text("{broken")
    with pytest.raises(config.AgentConfigError, match="remove it to join again"):
        config.load(host)
