"""The agent's own state on the host: the node token it got by joining (``etc/gpumode/agent.json``, 0600).

Only the node token is kept: the join token is single-use in most fleets, and a stolen ``agent.json`` must
not let anyone join other hosts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from gpumode.host.root import Host
from gpumode.modes.journal import atomic_write

CONFIG_PATH = "etc/gpumode/agent.json"


class AgentConfigError(ValueError):
    """``agent.json`` is unreadable or malformed; the message names the file."""


@dataclass(frozen=True, slots=True)
class AgentConfig:
    server: str
    node: str
    token: str


def config_path(host: Host) -> Path:
    return host.path(CONFIG_PATH)


def load(host: Host) -> AgentConfig | None:
    """The stored node token, or ``None`` when the agent has not joined yet."""
    path = config_path(host)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return AgentConfig(server=str(data["server"]), node=str(data["node"]), token=str(data["token"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AgentConfigError(
            f"{path}: unreadable agent configuration ({exc}); remove it to join again"
        ) from exc


def save(host: Host, config: AgentConfig) -> Path:
    """Write ``agent.json`` readable by its owner only (it holds a bearer token)."""
    path = config_path(host)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"server": config.server, "node": config.node, "token": config.token}, indent=2)
    old = os.umask(0o077)  # the temporary file is created 0600 too, never readable by others
    try:
        atomic_write(path, body + "\n")
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return path
