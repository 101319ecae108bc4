"""What keeps a host from a desired state: the one check behind ``gpumode assert`` and behind every run's and
rollback's claim of success.

Per GPU it checks the discovered mode; in ``vgpu`` the vGPUs' type and count when asked; in ``passthrough``
every non-bridge function of the GPU's IOMMU group (and its consumer links) on vfio-pci; in every other mode
none of them left on vfio-pci. It also finds a ``driver_override`` that names another driver than the mode's,
VFs left enabled outside ``vgpu`` mode, and mdevs whose parent is no GPU's (orphans). No GPU to check is a
difference too: a host with no GPUs is in no mode.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gpumode.domain import Gpu, HostSnapshot, Mode, Plan
from gpumode.host.root import Host
from gpumode.modes.catalog import Catalog
from gpumode.modes.policy import VgpuOffer, vgpu_offer

VFIO_DRIVERS = frozenset({"vfio-pci", "nvgrace_gpu_vfio_pci"})
BRIDGE_CLASSES = frozenset({0x0600, 0x0604, 0x0609})  # bridges keep pcieport: it is VFIO-compatible


@dataclass(frozen=True, slots=True)
class Want:
    """The state one GPU should be in."""

    mode: Mode
    vgpu_type: str | None = None  # a name (L40S-4Q, NVIDIA L40S-4Q) or id; None: any type
    vgpu_count: int | None = None  # None: any number


def differences(host: Host, snapshot: HostSnapshot, wants: Mapping[str, Want], catalog: Catalog) -> list[str]:
    """Everything that keeps the GPUs in ``wants`` from their wanted state; empty when they are in it."""
    if not wants:
        where = f"host {snapshot.hostname}" if snapshot.hostname else "this host"
        return [f"no GPU to check: {where} (root {host.root}) shows no NVIDIA GPU"]
    out: list[str] = []
    for address, want in sorted(wants.items()):
        gpu = snapshot.gpu(address)
        if gpu is None:
            out.append(f"{address}: no such GPU on this host")
            continue
        out += _gpu_differences(snapshot, gpu, want, catalog)
    for uuid in orphan_mdevs(host, snapshot):
        remove = f"echo 1 > /sys/bus/mdev/devices/{uuid}/remove"
        out.append(f"orphan mdev {uuid}: its parent is no GPU's (`{remove}`)")
    return out


def _gpu_differences(snapshot: HostSnapshot, gpu: Gpu, want: Want, catalog: Catalog) -> list[str]:
    address, mode = gpu.address, want.mode
    out = []
    if gpu.mode is not mode:
        out.append(f"{address}: mode {gpu.mode.value}, expected {mode.value} (driver {gpu.driver or 'none'})")
    members = [address, *gpu.companions]
    for member in members:
        fn = snapshot.function(member)
        if fn is None or (fn.class_code >> 8) in BRIDGE_CLASSES:
            continue
        what = "" if member == address else f"companion {member} "
        if member != address and mode is Mode.PASSTHROUGH and fn.driver not in VFIO_DRIVERS:
            out.append(f"{address}: {what}is on {fn.driver or 'no driver'}, expected vfio-pci")
        elif member != address and mode is not Mode.PASSTHROUGH and fn.driver in VFIO_DRIVERS:
            out.append(f"{address}: {what}is still on {fn.driver}")
        override = fn.driver_override
        if override and not (mode is Mode.PASSTHROUGH and override in VFIO_DRIVERS):
            out.append(
                f"{address}: {what}carries driver_override={override} in mode {mode.value} "
                f"(clear it: `echo > /sys/bus/pci/devices/{member}/driver_override`)"
            )
    if mode is not Mode.VGPU and gpu.vfs:
        out.append(
            f"{address}: {len(gpu.vfs)} SR-IOV VFs still enabled in mode {mode.value} "
            f"(disable them: `echo 0 > /sys/bus/pci/devices/{address}/sriov_numvfs`)"
        )
    vgpus = vgpu_types(snapshot, gpu)
    if mode is not Mode.VGPU and vgpus:
        out.append(f"{address}: {len(vgpus)} vGPUs left in mode {mode.value}")
    if mode is Mode.VGPU:
        out += _vgpu_differences(snapshot, gpu, want, vgpus, catalog)
    return out


def _vgpu_differences(
    snapshot: HostSnapshot, gpu: Gpu, want: Want, vgpus: list[int], catalog: Catalog
) -> list[str]:
    address, out = gpu.address, []
    if want.vgpu_count is not None and len(vgpus) != want.vgpu_count:
        out.append(f"{address}: {len(vgpus)} vGPUs, expected {want.vgpu_count}")
    if want.vgpu_type is not None:
        offer = vgpu_offer(snapshot, gpu, catalog)
        wanted = offer.find(want.vgpu_type) if offer is not None else None
        if wanted is None:
            out.append(f"{address}: offers no vGPU type {want.vgpu_type!r}")
        else:
            wrong = sorted({t for t in vgpus if t != wanted.id})
            if wrong and offer is not None:
                names = ", ".join(_type_name(offer, t) for t in wrong)
                out.append(f"{address}: vGPUs of type {names}, expected {wanted.name}")
    return out


def _type_name(offer: VgpuOffer, type_id: int) -> str:
    found = offer.find(str(type_id))
    return f"{found.name} ({type_id})" if found is not None else str(type_id)


def vgpu_types(snapshot: HostSnapshot, gpu: Gpu) -> list[int]:
    """The type id of each vGPU the GPU has now (mdevs on it or its VFs, vendor vGPU VFs)."""
    out = []
    for fn in (snapshot.function(a) for a in [gpu.address, *gpu.vfs]):
        if fn is None:
            continue
        for mdev in fn.mdevs:
            tail = mdev.type_id.rsplit("-", 1)[-1]
            out.append(int(tail) if tail.isdigit() else -1)
        if fn.vendor_vgpu is not None and fn.vendor_vgpu.current:
            out.append(fn.vendor_vgpu.current)
    return out


def orphan_mdevs(host: Host, snapshot: HostSnapshot) -> list[str]:
    """mdevs on the mdev bus that belong to no GPU discovery knows (their parent vanished or is not a GPU)."""
    bus = host.path("sys/bus/mdev/devices")
    present = set(os.listdir(bus)) if bus.is_dir() else set()
    return sorted(present - {u for g in snapshot.gpus for u in g.mdevs})


def plan_wants(plan: Plan, *, rolled_back: bool) -> dict[str, Want]:
    """What a finished run claims for each GPU of ``plan``: the mode before it (rolled back), or the target
    with the vGPU type and count its cards name (done)."""
    if rolled_back:
        return {address: Want(before) for address, (before, _after) in plan.impact.gpus.items()}
    wants = {address: Want(after) for address, (_before, after) in plan.impact.gpus.items()}
    for step in plan.steps:
        if step.action != "cloud.register_cards":
            continue
        for card in step.params.get("cards") or []:
            address = card.get("gpu")
            if address in wants and wants[address].mode is Mode.VGPU:
                wants[address] = Want(Mode.VGPU, card.get("vgpu_type"), card.get("vgpu_count"))
    return wants
