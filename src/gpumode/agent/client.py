"""The agent's HTTP client, on the HTTP layer the remote CLI uses too (:mod:`gpumode.apiclient`): every call
to the server, retried with exponential backoff while the server is away (connection refused, timeouts,
5xx), until it answers or the agent is told to stop.

A 4xx answer is not retried: it means the request itself is wrong, and repeating it cannot help; the caller
decides what to do with :class:`ApiError`. Except 401 and 403 to a client with :class:`Credentials` (the
agent's node token): the token is no longer valid, and the call is retried with backoff, with the token the
credentials give at each try, until one is accepted (:mod:`gpumode.agent.credentials`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Protocol

import httpx
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential, wait_random

from gpumode import __version__, wire
from gpumode.apiclient import ApiClient
from gpumode.apiclient import ApiError as ApiError  # the one error type of both clients (gpumode.apiclient)
from gpumode.modes.steps import default_registry
from gpumode.tls import verify_context

log = logging.getLogger(__name__)


class TokenRefused(ApiError):
    """401/403: the server does not accept the token (revoked, or the node was replaced)."""


class Credentials(Protocol):
    """Where a client's token comes from, and whom to tell when the server refuses or accepts it."""

    def current(self) -> str: ...

    def refused(self, token: str, status: int, detail: object) -> None: ...

    def accepted(self, token: str) -> None: ...


class Stopped(RuntimeError):
    """The agent is stopping: a call waiting for the server gave up."""


def _retryable(exc: BaseException) -> bool:
    """The server is away (unreachable, 5xx: restarting, database away), or refuses our token."""
    return isinstance(exc, ApiError) and (exc.away or isinstance(exc, TokenRefused))


class Client:
    """Calls to one server with one bearer token; ``stop`` ends retries (and their waits) at once."""

    def __init__(
        self,
        server: str,
        token: str,
        *,
        stop: threading.Event | None = None,
        max_backoff_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        credentials: Credentials | None = None,
        ca: Path | None = None,
        protocol: wire.Protocol = wire.PROTOCOL,
    ) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self.credentials = credentials
        self.stop = stop or threading.Event()
        self.max_backoff_s = max_backoff_s
        # what this agent speaks, said with each request (the server reads it on work polls; gpumode.wire)
        hello = wire.hello_headers(protocol, __version__, default_registry().actions())
        # the system trust store, or the operator's CA (gpumode.tls); a bad CA file is refused at start
        self._api = ApiClient(
            self.server, timeout_s=30.0, transport=transport, verify=verify_context(ca), headers=hello
        )

    def close(self) -> None:
        self._api.close()

    # --- one call, retried ----------------------------------------------------------------------------------

    def call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        token: str | None = None,
        retry: bool = True,
    ) -> httpx.Response:
        """One request; retried while the server is away. Returns 2xx responses, raises :class:`ApiError`."""
        what = f"{method} {path}"
        watched = self.credentials if token is None else None

        def once() -> httpx.Response:
            bearer = token or (watched.current() if watched is not None else self.token)
            try:
                response = self._api.send(
                    method, path, json=json, content=content, params=params, timeout=timeout, token=bearer
                )
            except ApiError as exc:
                if watched is not None and exc.status in (401, 403):
                    watched.refused(bearer, exc.status, exc.detail)
                    raise TokenRefused(
                        exc.message, status=exc.status, detail=exc.detail, what=what, reply=exc.reply
                    ) from exc
                raise
            if watched is not None:
                watched.accepted(bearer)
            return response

        if not retry:
            return once()
        retrying = Retrying(
            retry=retry_if_exception(_retryable),
            # doubling from 0.2 s up to max_backoff_s, plus jitter so a fleet does not retry in step
            wait=wait_exponential(multiplier=0.2, max=self.max_backoff_s)
            + wait_random(0, min(1.0, self.max_backoff_s)),
            stop=lambda _state: self.stop.is_set(),
            sleep=self._sleep,
            before_sleep=lambda state: self._log_retry(what, state),
            reraise=True,
        )
        try:
            result: httpx.Response = retrying(once)
        except ApiError as exc:
            if not _retryable(exc):
                raise
            raise Stopped(f"{what}: gave up, the agent is stopping ({exc})") from exc
        return result

    def _sleep(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Stopped("the agent is stopping")

    def _log_retry(self, what: str, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        if isinstance(exc, TokenRefused):  # said once, by the credentials
            log.debug("%s: token refused; retry %d in %.1fs", what, state.attempt_number, wait)
            return
        log.warning(
            "server unreachable for %s (%s); retry %d in %.1fs", what, exc, state.attempt_number, wait
        )

    # --- the API the agent uses -----------------------------------------------------------------------------

    def join(self, hostname: str, snapshot: dict[str, Any], node_token: str | None = None) -> dict[str, Any]:
        """Trade the join token for a node token; re-joining a node needs its current ``node_token``."""
        request: dict[str, Any] = {"hostname": hostname, "snapshot": snapshot}
        if node_token is not None:
            request["node_token"] = node_token
        body: dict[str, Any] = self.call("POST", "/agents/join", json=request).json()
        return body

    def report(self, node: str, body: bytes) -> dict[str, Any]:
        answer: dict[str, Any] = self.call("POST", f"/nodes/{node}/report", content=body).json()
        return answer

    def work(self, node: str, wait: float) -> dict[str, Any] | None:
        """The next job, or ``None`` when none came within ``wait`` seconds."""
        response = self.call("GET", f"/nodes/{node}/work", params={"wait": wait}, timeout=wait + 15.0)
        if response.status_code == 204:
            return None
        job: dict[str, Any] = response.json()["job"]
        job["plan"] = wire.read_plan(job["plan"])  # a plan schema this agent does not know is refused
        return job

    def job(self, job_id: int) -> dict[str, Any]:
        body: dict[str, Any] = self.call("GET", f"/jobs/{job_id}").json()
        return body

    def job_events(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]:
        answer: dict[str, Any] = self.call("POST", f"/jobs/{job_id}/events", json=body).json()
        return answer
