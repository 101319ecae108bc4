"""Nova around a switch: take the host out of scheduling, move its instances out of the way, and put it back.

:func:`hold_host` returns a :class:`Hold`, a JSON-able record of what it did, so :func:`release_host` can undo
exactly that (possibly in another server process, after a restart): the service is re-enabled only if gpumode
disabled it, and after a failed switch the instances are started / unshelved again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from gpumode.cloud.openstack.compute import Action, ComputeApi, Instance
from gpumode.cloud.openstack.config import OpenStackConfig
from gpumode.cloud.openstack.http import OpenStackError
from gpumode.domain import VmPolicy

REASON_PREFIX = "gpumode"
_UNDO: dict[str, Action | None] = {"stop": "start", "shelve": "unshelve", "live_migrate": None}
_IDLE = frozenset({"SHUTOFF", "SHELVED", "SHELVED_OFFLOADED", "ERROR", "DELETED", "SOFT_DELETED"})


@dataclass(slots=True)
class MovedInstance:
    id: str
    name: str
    action: str  # stop | shelve | live_migrate


@dataclass(slots=True)
class Hold:
    node: str
    service_id: str
    disabled_by_us: bool
    reason: str
    moved: list[MovedInstance] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hold:
        moved = [MovedInstance(**m) for m in data.get("moved", [])]
        return cls(data["node"], data["service_id"], data["disabled_by_us"], data["reason"], moved)


@dataclass(slots=True)
class Waiter:
    """Polls until a condition holds; injectable so tests do not sleep."""

    timeout_s: float
    interval_s: float
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def until(self, what: str, done: Callable[[], str | None]) -> None:
        """``done`` returns None when finished, else what is still missing (for the timeout message)."""
        deadline = self.clock() + self.timeout_s
        while True:
            missing = done()
            if missing is None:
                return
            if self.clock() >= deadline:
                raise OpenStackError(f"timed out after {self.timeout_s:g}s waiting for {what}: {missing}")
            self.sleep(self.interval_s)


def hold_host(
    compute: ComputeApi,
    config: OpenStackConfig,
    node: str,
    *,
    job: str,
    policy: VmPolicy,
    waiter: Waiter,
) -> Hold:
    """Disable the node's nova-compute service and apply the VM policy; on failure nothing stays changed."""
    service = compute.find_service(node)
    if service is None:
        raise OpenStackError(f"Nova has no nova-compute service on host {node}")
    reason = f"{REASON_PREFIX} {job}: GPU mode switch"
    # Disabled with this job's own reason: an earlier attempt (a server that died midway) did it; still ours.
    hold = Hold(node, service.id, service.enabled or service.disabled_reason == reason, reason)
    if service.enabled:
        compute.set_service(service.id, enabled=False, reason=reason)
    try:
        _move_instances(compute, config, hold, policy, waiter)
    except Exception:
        release_host(compute, hold, succeeded=False, waiter=waiter)
        raise
    return hold


def _move_instances(
    compute: ComputeApi, config: OpenStackConfig, hold: Hold, policy: VmPolicy, waiter: Waiter
) -> None:
    running = [i for i in compute.instances(hold.node) if i.status not in _IDLE]
    touched = running if policy is VmPolicy.ALL else [i for i in running if i.uses_gpu]
    if policy is VmPolicy.REFUSE and touched:
        names = ", ".join(sorted(i.name for i in touched))
        raise OpenStackError(f"vm_policy refuse: instances with GPUs are running on {hold.node}: {names}")
    for inst in sorted(touched, key=lambda i: i.name):
        action: Action = "live_migrate" if config.live_migrate_vgpu and inst.uses_vgpu else config.vm_action
        compute.act(inst.id, action)
        hold.moved.append(MovedInstance(inst.id, inst.name, action))
    for moved in hold.moved:
        waiter.until(f"instance {moved.name} to {moved.action}", partial(_moved, compute, hold.node, moved))


def _moved(compute: ComputeApi, node: str, moved: MovedInstance) -> str | None:
    inst = compute.instance(moved.id)
    if inst is None:
        return None
    if inst.status == "ERROR":
        raise OpenStackError(f"instance {moved.name} went to ERROR during {moved.action}")
    return None if _settled(inst, moved.action, node) else f"it is {inst.status} on {inst.host}"


def _settled(inst: Instance, action: str, node: str) -> bool:
    if action == "stop":
        return inst.status == "SHUTOFF"
    if action == "shelve":
        return inst.status in ("SHELVED", "SHELVED_OFFLOADED")
    return inst.status == "ACTIVE" and inst.host not in (None, node)


def release_host(compute: ComputeApi, hold: Hold, *, succeeded: bool, waiter: Waiter) -> list[str]:
    """Re-enable the service (if gpumode disabled it); after a failed switch bring moved instances back.

    Returns what could not be undone; the service is re-enabled even when restarting an instance fails.
    """
    problems: list[str] = []
    if not succeeded:
        for moved in reversed(hold.moved):
            undo = _UNDO.get(moved.action)
            if undo is None:
                continue  # a migrated instance runs elsewhere; moving it back is the operator's choice
            try:
                compute.act(moved.id, undo)
            except OpenStackError as exc:
                problems.append(f"{undo} {moved.name}: {exc}")
    if hold.disabled_by_us:
        service = compute.find_service(hold.node)
        if service is not None and not service.enabled and service.disabled_reason == hold.reason:
            compute.set_service(service.id, enabled=True)
        elif service is not None and not service.enabled:
            problems.append(
                f"nova-compute on {hold.node} left disabled: "
                f"someone else disabled it ({service.disabled_reason})"
            )
    return problems
