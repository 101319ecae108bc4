"""Users' vGPU layouts from Cyborg device profiles, behind :class:`ProfileSource`.

A device profile is a list of request groups (``resources:*``, ``trait:*``, ``accel:*`` keys). A group
describes a gpumode vGPU layout when it asks for ``resources:VGPU`` and carries ``accel:vgpu_type`` (the type,
e.g. ``nvidia-222`` or ``GRID T4-1Q``) and ``accel:vgpus_per_gpu`` (how many to carve per GPU). Other profiles
(FPGAs, whole GPUs) are not vGPU layouts and are skipped.
"""

from __future__ import annotations

from typing import Any, Protocol

from gpumode.cloud.base import VgpuProfile
from gpumode.cloud.openstack.http import OpenStackError, ServiceClient

MICROVERSION = "2.0"


class ProfileSource(Protocol):
    def vgpu_profiles(self) -> list[VgpuProfile]: ...


class CyborgProfiles:
    """:class:`ProfileSource` over Cyborg's ``GET /v2/device_profiles`` (``service_type = accelerator``)."""

    def __init__(self, client: ServiceClient) -> None:
        self.client = client

    def vgpu_profiles(self) -> list[VgpuProfile]:
        _, data = self.client.call("GET", "/v2/device_profiles")
        return profiles_from_cyborg(data["device_profiles"])


def profiles_from_cyborg(device_profiles: list[dict[str, Any]]) -> list[VgpuProfile]:
    out: list[VgpuProfile] = []
    for dp in device_profiles:
        for group in dp.get("groups") or []:
            if "resources:VGPU" not in group or "accel:vgpu_type" not in group:
                continue
            try:
                count = int(group.get("accel:vgpus_per_gpu", ""))
            except ValueError:
                raise OpenStackError(
                    f"Cyborg device profile {dp.get('name')!r}: accel:vgpus_per_gpu must be a whole number, "
                    f"not {group.get('accel:vgpus_per_gpu')!r}"
                ) from None
            if count < 1:
                raise OpenStackError(
                    f"Cyborg device profile {dp.get('name')!r}: accel:vgpus_per_gpu must be >= 1"
                )
            out.append(VgpuProfile(dp["name"], group["accel:vgpu_type"], count, dp.get("description") or ""))
            break
    return sorted(out, key=lambda p: p.name)
