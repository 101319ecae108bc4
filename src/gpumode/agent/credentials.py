"""The node token the agent calls the server with, and what it does when the server stops accepting it.

A 401 or 403 answer to the agent's own calls means its token is no longer valid (revoked, or the node was
taken over by a replacement): no retry with the same token can help, but exiting would only make a supervisor
restart the agent into the same refusal. So the agent keeps the host exactly as it is (no job, no change to
its desired state), logs the refusal once, writes it to its status file, and keeps retrying with backoff,
reading ``agent.json`` before each try: a new node token written there (or a restart with a join token, see
``daemon.Agent.connect``) is picked up and the agent carries on.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpumode.agent import config as agent_config
from gpumode.host.root import Host
from gpumode.modes.journal import atomic_write

log = logging.getLogger(__name__)

STATUS_PATH = "var/lib/gpumode/agent/status.json"


def status_path(host: Host) -> Path:
    return host.path(STATUS_PATH)


def read_status(host: Host) -> dict[str, Any] | None:
    """The agent's last written status (``state``: ``ok`` | ``token_refused``), ``None`` before the first."""
    try:
        data: dict[str, Any] = json.loads(status_path(host).read_text())
    except (OSError, ValueError):
        return None
    return data


class NodeCredentials:
    """The node token of ``node`` on ``server``: the one stored in ``agent.json`` when that file is for this
    server and node, else the one the agent started with."""

    def __init__(self, host: Host, server: str, node: str, token: str) -> None:
        self.host = host
        self.server = server
        self.node = node
        self._token = token
        self._refused: str | None = None  # the token the server refused, until one is accepted
        self._ok = False  # the status file says "ok"
        self._lock = threading.Lock()

    def current(self) -> str:
        try:
            stored = agent_config.load(self.host)
        except agent_config.AgentConfigError:
            stored = None
        if stored is not None and stored.server == self.server and stored.node == self.node:
            with self._lock:
                self._token = stored.token
        return self._token

    def refused(self, token: str, status: int, detail: object) -> None:
        """The server refused ``token``: say so once (per token), in the log and the status file."""
        with self._lock:
            if self._refused == token:
                return
            self._refused, self._ok = token, False
        message = (
            f"the server refused this node's token (HTTP {status}: {detail}); it was revoked or the node "
            f"was replaced. The host is left as it is and the agent retries; to give it a new token, restart "
            f"it with --token and a join token (after an admin's `gpumode token replace {self.node}`), or "
            f"write a node token to {agent_config.config_path(self.host)}"
        )
        log.error("%s", message)
        self._write("token_refused", message)

    def accepted(self, token: str) -> None:
        with self._lock:
            if self._ok and self._refused is None:
                return
            recovered, self._refused, self._ok = self._refused is not None, None, True
        if recovered:
            log.info("the server accepts the node token again; carrying on")
        self._write("ok", "the server accepts the node token")

    def _write(self, state: str, message: str) -> None:
        body = {
            "state": state,
            "since": datetime.now(UTC).isoformat(),
            "server": self.server,
            "node": self.node,
            "message": message,
        }
        path = status_path(self.host)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(body, indent=2) + "\n")
        except OSError as exc:  # the status is a courtesy; the agent carries on without it
            log.warning("could not write %s: %s", path, exc)
