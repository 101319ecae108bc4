"""The desired mode of each GPU, persisted on the host so it survives a reboot.

A reboot loses what the kernel holds: SR-IOV VFs, vGPU types, mdevs (without mdevctl), vfio-pci bindings
(without driverctl). gpumode writes ``<root>/etc/gpumode/desired.json`` whenever a plan succeeds and ``gpumode
apply --from-desired`` (run at boot) plans each GPU back to it from a fresh discovery — so the host, not the
tool that last touched it, says what it should be.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumode.domain import Mode, Plan, SwitchRequest, VmPolicy
from gpumode.errors import GpumodeError
from gpumode.host.root import Host
from gpumode.modes.journal import atomic_write

DESIRED_SCHEMA = "gpumode.desired/v1"
DESIRED_PATH = "etc/gpumode/desired.json"


class DesiredStateError(GpumodeError, ValueError):
    """The desired-state file is unreadable or malformed; the message names the file and the problem."""

    default_code = "bad_desired_state"


@dataclass(frozen=True, slots=True)
class GpuDesire:
    """What one GPU should be: a mode and that mode's options."""

    mode: Mode
    vgpu_type: str | None = None
    vgpu_count: int | None = None
    passthrough_alias: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": str(self.mode),
            "vgpu_type": self.vgpu_type,
            "vgpu_count": self.vgpu_count,
            "passthrough_alias": self.passthrough_alias,
        }


@dataclass(slots=True)
class DesiredState:
    gpus: dict[str, GpuDesire] = field(default_factory=dict)  # PCI address -> desire
    updated_at: float | None = None
    plan_id: str | None = None  # the plan that last wrote it
    # what that plan replaced (address -> desire, None: had none), so undoing a finished run can put it back
    previous: dict[str, GpuDesire | None] = field(default_factory=dict)

    def requests(self, vm_policy: VmPolicy = VmPolicy.GPU) -> list[SwitchRequest]:
        """Group GPUs that want the same thing into one request each, in a stable order.

        Passthrough goes first: it only releases GPUs, so it never needs a driver another group is about to
        load.
        """
        groups: dict[GpuDesire, list[str]] = {}
        for address in sorted(self.gpus):
            groups.setdefault(self.gpus[address], []).append(address)
        order = {Mode.PASSTHROUGH: 0, Mode.NONE: 1, Mode.ACCEL: 2, Mode.VGPU: 3}
        ordered = sorted(groups.items(), key=lambda kv: (order[kv[0].mode], kv[1]))
        return [
            SwitchRequest(
                mode=d.mode,
                gpus=addresses,
                vgpu_type=d.vgpu_type,
                vgpu_count=d.vgpu_count,
                passthrough_alias=d.passthrough_alias,
                vm_policy=vm_policy,
            )
            for d, addresses in ordered
        ]


def desired_path(host: Host) -> Path:
    return host.path(DESIRED_PATH)


def load_desired(host: Host) -> DesiredState:
    """The host's desired state; empty when none was ever written."""
    path = desired_path(host)
    if not path.exists():
        return DesiredState()
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != DESIRED_SCHEMA:
            raise DesiredStateError(f"{path}: schema is {data.get('schema')!r}, expected {DESIRED_SCHEMA!r}")
        gpus = {
            address: GpuDesire(
                mode=Mode(d["mode"]),
                vgpu_type=d.get("vgpu_type"),
                vgpu_count=d.get("vgpu_count"),
                passthrough_alias=d.get("passthrough_alias"),
            )
            for address, d in data["gpus"].items()
        }
        previous = {
            address: None
            if d is None
            else GpuDesire(
                mode=Mode(d["mode"]),
                vgpu_type=d.get("vgpu_type"),
                vgpu_count=d.get("vgpu_count"),
                passthrough_alias=d.get("passthrough_alias"),
            )
            for address, d in (data.get("previous") or {}).items()
        }
    except DesiredStateError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DesiredStateError(f"{path}: malformed desired state: {exc}") from exc
    return DesiredState(
        gpus=gpus, updated_at=data.get("updated_at"), plan_id=data.get("plan_id"), previous=previous
    )


def save_desired(host: Host, state: DesiredState) -> None:
    state.updated_at = time.time()
    body = {
        "schema": DESIRED_SCHEMA,
        "updated_at": state.updated_at,
        "plan_id": state.plan_id,
        "gpus": {a: state.gpus[a].to_dict() for a in sorted(state.gpus)},
    }
    if state.previous:
        body["previous"] = {a: None if d is None else d.to_dict() for a, d in sorted(state.previous.items())}
    atomic_write(desired_path(host), json.dumps(body, indent=2) + "\n")


def record_success(host: Host, request: SwitchRequest, gpus: list[str], plan_id: str) -> DesiredState:
    """Fold a successful switch into the desired state: each of ``gpus`` now wants the request's mode."""
    state = load_desired(host)
    desire = GpuDesire(
        mode=request.mode,
        vgpu_type=request.vgpu_type if request.mode is Mode.VGPU else None,
        vgpu_count=request.vgpu_count if request.mode is Mode.VGPU else None,
        passthrough_alias=request.passthrough_alias if request.mode is Mode.PASSTHROUGH else None,
    )
    state.previous = {address: state.gpus.get(address) for address in gpus}
    for address in gpus:
        state.gpus[address] = desire
    state.plan_id = plan_id
    save_desired(host, state)
    return state


def undo_success(host: Host, plan_id: str) -> bool:
    """Put back what :func:`record_success` of ``plan_id`` replaced (its run is being undone). Only while
    that plan is the last one recorded; ``False`` when there is nothing (left) to put back, so it is safe to
    call twice."""
    state = load_desired(host)
    if state.plan_id != plan_id or not state.previous:
        return False
    for address, desire in state.previous.items():
        if desire is None:
            state.gpus.pop(address, None)
        else:
            state.gpus[address] = desire
    state.previous = {}
    state.plan_id = None
    save_desired(host, state)
    return True


def plan_gpus(plan: Plan) -> list[str]:
    """The GPUs a plan is about: those in its impact (every requested GPU), else those its request names."""
    return sorted(plan.impact.gpus) or sorted(plan.request.gpus)
