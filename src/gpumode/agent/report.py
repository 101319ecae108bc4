"""What the agent tells the server about its host: the snapshot (method step 1) and the VMs beside it.

Discovery is cheap, so the agent re-reads the host every few seconds and reports at once when the snapshot
or the VMs changed; otherwise it reports every ``interval`` seconds (the server's liveness view). The body is
built the same way every time, so an unchanged host sends the same bytes and the server's fast path skips it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from gpumode.agent.client import ApiError, Client, Stopped
from gpumode.domain import HostSnapshot, Vm
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.host.vms import open_hypervisor

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HostView:
    snapshot: HostSnapshot
    vms: list[Vm] | None  # None: the hypervisor could not be read (no libvirt): the server keeps what it had

    def body(self) -> dict[str, Any]:
        data = self.snapshot.to_dict()
        if self.vms is not None:
            data["vms"] = [
                {
                    "name": vm.name,
                    "uuid": vm.uuid,
                    "running": vm.running,
                    "devices": [{"kind": d.kind, "id": d.id} for d in sorted(vm.devices, key=str)],
                }
                for vm in sorted(self.vms, key=lambda v: v.name)
            ]
        return data

    def encoded(self) -> bytes:
        return json.dumps(self.body(), separators=(",", ":")).encode()


def look(host: Host) -> HostView:
    """Discover the host and list its VMs."""
    snapshot = discover(host)
    try:
        vms: list[Vm] | None = open_hypervisor(host).list_vms()
    except Exception as exc:  # no libvirt on this host, or it is down: report the hardware anyway
        log.debug("cannot list VMs: %s", exc)
        vms = None
    return HostView(snapshot, vms)


class SnapshotReporter:
    """Reports the host when it changed (checked every ``check_s``) and at least every ``interval_s``.

    ``paused`` is set while a job runs: mid-switch snapshots would make the server reshuffle cards at every
    step; the job reports the host once it is over.
    """

    def __init__(
        self,
        host: Host,
        client: Client,
        node: str,
        *,
        interval_s: float,
        check_s: float,
        stop: threading.Event,
    ) -> None:
        self.host = host
        self.client = client
        self.node = node
        self.interval_s = interval_s
        self.check_s = check_s
        self.stop = stop
        self.paused = threading.Event()
        self._lock = threading.Lock()
        self._last_digest: str | None = None
        self._last_sent = 0.0
        self._thread: threading.Thread | None = None

    def report(self, *, force: bool = False) -> bool:
        """Discover and report if the host changed, the interval passed, or ``force``; ``True`` if sent."""
        with self._lock:
            view = look(self.host)
            body = view.encoded()
            digest = hashlib.sha256(body).hexdigest()
            due = time.monotonic() - self._last_sent >= self.interval_s
            if not (force or due or digest != self._last_digest):
                return False
            changed = digest != self._last_digest
            answer = self.client.report(self.node, body)
            self._last_digest, self._last_sent = digest, time.monotonic()
            if changed:
                log.info(
                    "reported %s (%s GPU(s), fingerprint %s): server %s",
                    self.node,
                    len(view.snapshot.gpus),
                    view.snapshot.fingerprint[:19],
                    "stored a change" if answer.get("changed") else "already had it",
                )
            return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gpumode-report", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self.stop.wait(self.check_s):
            if self.paused.is_set():
                continue
            try:
                self.report()
            except Stopped:
                return
            except ApiError as exc:
                log.error("the server refused the report: %s", exc)
            except Exception:  # a discovery hiccup must not kill the loop; the next tick tries again
                log.exception("reporting the host failed")
