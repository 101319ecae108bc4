"""How the drop-in reaches a host and nova-compute is restarted there: :class:`NodeChannel`.

On a server with remote agents the agent carries these out; :class:`HostChannel` does it through
:class:`~gpumode.host.root.Host` for hosts this process can reach (the local engine, emulated hosts).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Protocol

from gpumode.host.root import CommandResult, Host


class NodeChannel(Protocol):
    def write_file(self, node: str, path: str, text: str) -> None: ...

    def run(self, node: str, argv: Sequence[str]) -> CommandResult: ...


class HostChannel:
    """A :class:`NodeChannel` over hosts by node name."""

    def __init__(self, hosts: Mapping[str, Host]) -> None:
        self.hosts = dict(hosts)

    def _host(self, node: str) -> Host:
        host = self.hosts.get(node)
        if host is None:
            raise LookupError(f"no host {node!r} reachable from here; known: {', '.join(sorted(self.hosts))}")
        return host

    def write_file(self, node: str, path: str, text: str) -> None:
        """Replace the file atomically (write aside, rename), so nova never reads half a drop-in."""
        target = self._host(node).path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.gpumode-tmp")
        tmp.write_text(text)
        os.replace(tmp, target)

    def run(self, node: str, argv: Sequence[str]) -> CommandResult:
        return self._host(node).run(argv)
