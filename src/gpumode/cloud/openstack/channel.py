"""How the drop-in reaches a host and nova-compute is restarted there: :class:`NodeChannel`.

On a server with remote agents the agent carries these out; :class:`HostChannel` does it through
:class:`~gpumode.host.root.Host` for hosts this process can reach (the local engine, emulated hosts).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Protocol

from gpumode.host.root import CommandResult, Host

NOVA_CONF = "/etc/nova/nova.conf"  # what nova-compute reads: this file, then the directory's *.conf by name
NOVA_CONF_D = "/etc/nova/nova.conf.d"


class NodeChannel(Protocol):
    def write_file(self, node: str, path: str, text: str) -> None: ...

    def run(self, node: str, argv: Sequence[str]) -> CommandResult: ...

    def read_nova_config(self, node: str) -> dict[str, str]:
        """Path → text of every file nova-compute reads on the node (``NOVA_CONF``,
        ``NOVA_CONF_D/*.conf``)."""
        ...


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

    def read_nova_config(self, node: str) -> dict[str, str]:
        host = self._host(node)
        found: dict[str, str] = {}
        conf, conf_d = host.path(NOVA_CONF), host.path(NOVA_CONF_D)
        if conf.is_file():
            found[NOVA_CONF] = conf.read_text()
        if conf_d.is_dir():
            for path in sorted(conf_d.glob("*.conf")):
                found[f"{NOVA_CONF_D}/{path.name}"] = path.read_text()
        return found
