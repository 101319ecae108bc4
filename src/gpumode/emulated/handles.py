"""Open device files: who holds a GPU, a VFIO device or an mdev, and the module references that follow.

The userspace half opens ``/dev/nvidia*`` for its daemons (nvidia-persistenced, a CUDA job); the emulated
hypervisor opens the VFIO device (or mdev) of each device a running VM uses. Those handles are what make a
real kernel answer EBUSY: a module in use cannot be removed, a GPU with clients cannot be unbound, an IOMMU
group opened through VFIO refuses kernel drivers, a vGPU held by a VM cannot be destroyed.
"""

from __future__ import annotations

import errno
from collections import Counter

from gpumode.emulated import drivers, nvidia
from gpumode.emulated.errors import kernel_error
from gpumode.emulated.state import Handle, HandleKind, KernelState

KINDS: tuple[HandleKind, ...] = ("nvidia", "vfio", "mdev")


def _check_vfio(state: KernelState, holder: str, address: str) -> None:
    dev = state.present(address)
    if dev is None:
        raise kernel_error(errno.ENODEV, f"no PCI device {address}")
    drv = state.drivers.get(dev.driver) if dev.driver else None
    if nvidia.is_vendor_vf(state, dev):
        if dev.vgpu_type == 0:
            raise kernel_error(
                errno.ENODEV, f"{address}: no vGPU type selected (nvidia/current_vgpu_type is 0)"
            )
    elif drv is None or not drv.vfio:
        raise kernel_error(errno.ENODEV, f"{address}: not bound to a VFIO driver (driver: {dev.driver})")
    group = dev.iommu_group
    if group is None:
        raise kernel_error(errno.ENODEV, f"{address}: no IOMMU group")
    if not drivers.group_viable(state, group):
        bad = [f"{d.address}={d.driver}" for d in drivers.group_members(state, group) if d.driver]
        raise kernel_error(
            errno.EBUSY,
            f"group {group} is not viable: all devices within the iommu_group must be bound to their "
            f"vfio bus driver ({', '.join(bad)})",
        )
    members = {d.address for d in drivers.group_members(state, group)}
    for h in state.handles:
        if h.kind == "vfio" and h.target in members and h.holder != holder:
            raise kernel_error(errno.EBUSY, f"group {group} is already owned by {h.holder}")


def open_handle(state: KernelState, holder: str, kind: HandleKind, target: str) -> None:
    """Open a device on behalf of ``holder``; idempotent for the same (holder, kind, target)."""
    if kind not in KINDS:
        raise ValueError(f"unknown handle kind {kind!r} (expected one of {', '.join(KINDS)})")
    if not holder:
        raise ValueError("a handle needs a holder name")
    if any(h.holder == holder and h.kind == kind and h.target == target for h in state.handles):
        return
    if kind == "nvidia":
        dev = state.present(target)
        if dev is None or dev.driver != nvidia.NVIDIA_DRIVER:
            raise kernel_error(errno.ENODEV, f"{target}: not a GPU bound to nvidia")
        if dev.unbind_lock:
            raise kernel_error(errno.EBUSY, f"{target}: unbindLock is held")
    elif kind == "vfio":
        _check_vfio(state, holder, target)
    else:
        if target not in state.mdevs:
            raise kernel_error(errno.ENODEV, f"no mdev {target}")
        other = next((h.holder for h in state.handles if h.kind == "mdev" and h.target == target), None)
        if other is not None:
            raise kernel_error(errno.EBUSY, f"mdev {target} is already open by {other}")
    state.handles.append(Handle(holder, kind, target))


def close_handle(state: KernelState, holder: str, kind: HandleKind, target: str) -> None:
    for h in state.handles:
        if h.holder == holder and h.kind == kind and h.target == target:
            state.handles.remove(h)
            return
    raise kernel_error(errno.EBADF, f"{holder} has no open {kind} handle on {target}")


def close_all(state: KernelState, holder: str) -> int:
    """Close every handle of ``holder`` (a process exits, a VM stops); returns how many were open."""
    before = len(state.handles)
    state.handles = [h for h in state.handles if h.holder != holder]
    return before - len(state.handles)


def module_references(state: KernelState) -> Counter[str]:
    """Module references held by open handles (try_module_get on open)."""
    refs: Counter[str] = Counter()
    for h in state.handles:
        if h.kind == "nvidia":
            refs["nvidia"] += 1
        elif h.kind == "mdev":
            refs[nvidia.VGPU_VFIO_MODULE] += 1
        else:
            dev = state.devices.get(h.target)
            drv = state.drivers.get(dev.driver) if dev and dev.driver else None
            if dev is not None and nvidia.is_vendor_vf(state, dev):
                refs[nvidia.VGPU_VFIO_MODULE] += 1
            elif drv is not None and drv.module:
                refs[drv.module] += 1
    return refs


def refcount(state: KernelState, module: str) -> int:
    """``/sys/module/<m>/refcnt``: modules depending on it plus open handles."""
    return len(state.holders_of(module)) + module_references(state)[module]
