"""A switch request and a plan as the database stores them (JSON columns) and the API shows them."""

from __future__ import annotations

from typing import Any

from gpumode.domain import Mode, Plan, SwitchRequest, VmPolicy


def request_json(request: SwitchRequest) -> dict[str, Any]:
    return {
        "mode": request.mode.value,
        "gpus": list(request.gpus),
        "vgpu_type": request.vgpu_type,
        "vgpu_count": request.vgpu_count,
        "passthrough_alias": request.passthrough_alias,
        "vm_policy": request.vm_policy.value,
        "allow_boot_vga": request.allow_boot_vga,
    }


def request_from_json(data: dict[str, Any]) -> SwitchRequest:
    return SwitchRequest(
        mode=Mode(data["mode"]),
        gpus=list(data.get("gpus") or []),
        vgpu_type=data.get("vgpu_type"),
        vgpu_count=data.get("vgpu_count"),
        passthrough_alias=data.get("passthrough_alias"),
        vm_policy=VmPolicy(data.get("vm_policy", VmPolicy.GPU.value)),
        allow_boot_vga=bool(data.get("allow_boot_vga", False)),
    )


def plan_json(plan: Plan) -> dict[str, Any]:
    """``Plan.to_dict()`` with JSON types (the impact's (before, after) tuples become lists)."""
    data = plan.to_dict()
    data["request"] = request_json(plan.request)
    data["impact"]["gpus"] = {a: [b.value, c.value] for a, (b, c) in plan.impact.gpus.items()}
    return data
