"""The agent's client: retries with backoff while the server is away, gives up at once when told to stop,
never retries a refusal (but a refused node token, until a valid one comes); and the stored node token is
private to its owner."""

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


def test_a_refused_node_token_is_retried_with_the_token_stored_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """401/403 to the agent's node token: said once, in the log and the status file; retried, reading
    ``agent.json`` each time, until a token is accepted."""
    from gpumode.agent.credentials import NodeCredentials, read_status

    host = Host(tmp_path)
    config.save(host, config.AgentConfig("http://server", "n1", "gpmn_old"))
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["authorization"])
        if request.headers["authorization"] != "Bearer gpmn_new":
            status = 401 if len(seen) % 2 else 403
            return httpx.Response(status, json={"detail": "missing or invalid bearer token"})
        return httpx.Response(200, json={"node": "n1", "changed": False, "fingerprint": "f"})

    def give_new_token_later() -> None:
        while len(seen) < 6:
            threading.Event().wait(0.01)
        assert read_status(host) is not None and read_status(host)["state"] == "token_refused"  # type: ignore[index]
        config.save(host, config.AgentConfig("http://server", "n1", "gpmn_new"))

    credentials = NodeCredentials(host, "http://server", "n1", "gpmn_old")
    client = Client(
        "http://server",
        "gpmn_old",
        max_backoff_s=0.02,
        transport=httpx.MockTransport(handler),
        credentials=credentials,
    )
    helper = threading.Thread(target=give_new_token_later)
    helper.start()
    with caplog.at_level("INFO", logger="gpumode.agent"):
        assert client.report("n1", b"{}")["changed"] is False
    helper.join(5)
    assert len(seen) > 6 and seen[-1] == "Bearer gpmn_new" and set(seen[:-1]) == {"Bearer gpmn_old"}
    refusals = [r for r in caplog.records if "refused this node's token" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelname == "ERROR"
    assert any("accepts the node token again" in r.getMessage() for r in caplog.records)
    status = read_status(host)
    assert status is not None and status["state"] == "ok" and status["node"] == "n1"


def test_a_refused_token_does_not_keep_a_stopping_agent(tmp_path: Path) -> None:
    from gpumode.agent.credentials import NodeCredentials

    stop = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        stop.set()
        return httpx.Response(401, json={"detail": "missing or invalid bearer token"})

    credentials = NodeCredentials(Host(tmp_path), "http://s", "n1", "gpmn_x")
    client = Client(
        "http://s",
        "gpmn_x",
        stop=stop,
        max_backoff_s=10,
        transport=httpx.MockTransport(handler),
        credentials=credentials,
    )
    with pytest.raises(Stopped):
        client.work("n1", 1)
