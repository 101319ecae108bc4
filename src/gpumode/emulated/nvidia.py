"""What the ``nvidia`` module and the vGPU manager (``nvidia_vgpu_vfio``) add to the kernel.

mdev parents and their types (pre-Ada vGPU), the vGPU 17+ vendor interface on VFs
(``nvidia/current_vgpu_type``),
``/proc/driver/nvidia`` (version, per-GPU information and ``unbindLock``), GPU usage counts from
``/dev/nvidia*`` clients, and what nvidia's remove() does on unbind. Pure functions over :class:`KernelState`.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources

from gpumode.emulated.errors import kernel_error, kstrtol, kstrtoul
from gpumode.emulated.spec import GpuModelSpec, VgpuInterface, VgpuTypeSpec
from gpumode.emulated.state import Device, KernelState, MdevState

NVIDIA_DRIVER = "nvidia"
VGPU_VFIO_MODULE = "nvidia_vgpu_vfio"
UUID_STRING_LEN = 36
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


# --- who is what --------------------------------------------------------------------------------------------


def vgpu_manager_active(state: KernelState) -> bool:
    """The vGPU build of ``nvidia`` is loaded together with ``nvidia_vgpu_vfio``."""
    core = state.module("nvidia")
    return core is not None and core.flavour == "vgpu" and state.module(VGPU_VFIO_MODULE) is not None


def physical_gpu(state: KernelState, dev: Device) -> Device:
    return state.devices[dev.physfn] if dev.physfn is not None else dev


# R580 (vGPU 19) on Linux 6.8+ registers no mdev parent at all, Ampere included: every SR-IOV GPU uses the
# vendor-specific VFIO framework on its VFs (public reports; the catalog's vgpu_interface_rules say the same).
VENDOR_ONLY_BRANCH = 580
VENDOR_ONLY_KERNEL = (6, 8)


def vgpu_interface(state: KernelState, model: GpuModelSpec) -> VgpuInterface | None:
    """The interface the loaded vGPU manager exposes for ``model``: the model's own, except that an R580+
    manager on a 6.8+ kernel offers only the vendor framework (and so nothing on a GPU without SR-IOV)."""
    if model.vgpu_interface != "mdev":
        return model.vgpu_interface
    core = state.module("nvidia")
    branch = int(core.version.split(".")[0]) if core is not None and core.version[:1].isdigit() else 0
    release = tuple(int(p) for p in state.kernel_release.split("-")[0].split(".")[:2] if p.isdigit())
    if branch >= VENDOR_ONLY_BRANCH and release >= VENDOR_ONLY_KERNEL:
        return "vendor" if model.sriov_total_vfs else None
    return "mdev"


def vgpus_on_vfs(state: KernelState, model: GpuModelSpec) -> bool:
    return vgpu_interface(state, model) == "vendor" or model.vgpus_on_vfs


def is_mdev_parent(state: KernelState, dev: Device) -> bool:
    """Registered mdev parent: bound to nvidia under the vGPU manager; the PF, or each VF on SR-IOV models."""
    model = state.model_of(dev)
    if dev.driver != NVIDIA_DRIVER or model is None or vgpu_interface(state, model) != "mdev":
        return False
    if not vgpu_manager_active(state):
        return False
    return dev.is_vf if model.vgpus_on_vfs else not dev.is_vf


def is_vendor_vf(state: KernelState, dev: Device) -> bool:
    """A VF with the vGPU 17+ ``nvidia/`` sysfs group."""
    model = state.model_of(dev)
    return (
        dev.is_vf
        and dev.driver == NVIDIA_DRIVER
        and model is not None
        and vgpu_interface(state, model) == "vendor"
        and vgpu_manager_active(state)
    )


def usage_count(state: KernelState, dev: Device) -> int:
    """Open ``/dev/nvidia*`` clients of this GPU (nvidia-persistenced, CUDA processes, ...)."""
    return sum(1 for h in state.handles if h.kind == "nvidia" and h.target == dev.address)


def _type_spec(state: KernelState, dev: Device, type_id: int) -> VgpuTypeSpec | None:
    model = state.model_of(dev)
    return next((t for t in model.vgpu_types if t.type_id == type_id), None) if model else None


# --- mdev (pre-Ada) -----------------------------------------------------------------------------------------


def mdevs_on_gpu(state: KernelState, pf: Device) -> list[MdevState]:
    return [
        m for m in state.mdevs.values() if physical_gpu(state, state.devices[m.parent]).address == pf.address
    ]


def available_instances(state: KernelState, parent: Device, vtype: VgpuTypeSpec) -> int:
    """Homogeneous placement: once a GPU holds a vGPU, only types of the same framebuffer size remain
    creatable."""
    existing = mdevs_on_gpu(state, physical_gpu(state, parent))
    for mdev in existing:
        spec = _type_spec(state, parent, mdev.type_id)
        if spec is not None and spec.framebuffer_mib != vtype.framebuffer_mib:
            return 0
    remaining = max(0, vtype.max_instances - len(existing))
    if parent.is_vf:  # one mdev per VF
        return 0 if any(m.parent == parent.address for m in existing) else min(1, remaining)
    return remaining


def create_mdev(state: KernelState, parent: Device, type_id: int, value: str) -> str:
    """``mdev_supported_types/nvidia-N/create`` ← UUID; returns the new mdev's (lowercase) uuid."""
    if not UUID_STRING_LEN <= len(value) <= UUID_STRING_LEN + 1:
        raise kernel_error(
            errno.EINVAL, f"expected a {UUID_STRING_LEN}-character UUID, got {len(value)} bytes"
        )
    text = value[:UUID_STRING_LEN]
    if not _UUID.match(text):
        raise kernel_error(errno.EINVAL, f"not a UUID: {text!r}")
    uuid = text.lower()
    if uuid in state.mdevs:
        raise kernel_error(errno.EEXIST, f"mdev {uuid} already exists")
    vtype = _type_spec(state, parent, type_id)
    if vtype is None or available_instances(state, parent, vtype) == 0:
        raise kernel_error(errno.EUSERS, f"no available instances of nvidia-{type_id} on {parent.address}")
    state.mdevs[uuid] = MdevState(uuid, parent.address, type_id, state.free_iommu_group())
    return uuid


def remove_mdev(state: KernelState, uuid: str, value: str) -> None:
    """``<uuid>/remove`` ← 1."""
    try:
        number = kstrtoul(value)
    except ValueError:
        raise kernel_error(errno.EINVAL, f"remove expects an integer, got {value!r}") from None
    if number == 0:
        return
    if any(h.kind == "mdev" and h.target == uuid for h in state.handles):
        raise kernel_error(errno.EBUSY, f"mdev {uuid} is open by a VM")
    del state.mdevs[uuid]


# --- vendor interface (vGPU 17+) ----------------------------------------------------------------------------


def creatable_types(
    state: KernelState, vf: Device, siblings: Sequence[Device] | None = None
) -> list[VgpuTypeSpec]:
    """Types this VF can still take, given what its sibling VFs hold (same framebuffer size, instances
    left). ``siblings``: ``state.vfs_of(vf.physfn)`` when the caller has it at hand."""
    model = state.model_of(vf)
    if model is None or vf.vgpu_type != 0 or vf.physfn is None:
        return []
    vfs = state.vfs_of(vf.physfn) if siblings is None else siblings
    taken = [d for d in vfs if d.vgpu_type != 0 and d.address != vf.address]
    sizes = {t.framebuffer_mib for d in taken if (t := _type_spec(state, vf, d.vgpu_type)) is not None}
    return [
        t
        for t in model.vgpu_types
        if (not sizes or t.framebuffer_mib in sizes) and t.max_instances - len(taken) > 0
    ]


def creatable_text(state: KernelState, vf: Device, siblings: Sequence[Device] | None = None) -> str:
    return "ID    : vGPU Name\n" + "".join(
        f"{t.type_id:<5d} : {t.name}\n" for t in creatable_types(state, vf, siblings)
    )


def write_current_vgpu_type(state: KernelState, vf: Device, value: str) -> None:
    """``<VF>/nvidia/current_vgpu_type`` ← type id (create) or 0 (destroy)."""
    try:
        type_id = kstrtol(value, 10)
    except ValueError:
        raise kernel_error(errno.EINVAL, f"current_vgpu_type expects a number, got {value!r}") from None
    if type_id == 0:
        if vf.vgpu_type == 0:
            raise kernel_error(errno.EPERM, f"{vf.address}: no vGPU type is set")
        if any(h.kind == "vfio" and h.target == vf.address for h in state.handles):
            raise kernel_error(
                errno.EBUSY, f"{vf.address}: VFIO device is open; close it before clearing the type"
            )
        vf.vgpu_type = 0
        vf.vfio_index = None
        return
    if vf.vgpu_type != 0:
        raise kernel_error(errno.EPERM, f"{vf.address}: vGPU type {vf.vgpu_type} already set")
    if type_id not in {t.type_id for t in creatable_types(state, vf)}:
        raise kernel_error(errno.EINVAL, f"{vf.address}: vGPU type {type_id} is not creatable here")
    vf.vgpu_type = type_id
    vf.vfio_index = state.free_vfio_index()


# --- unbind / unload side effects ---------------------------------------------------------------------------


def before_unbind(state: KernelState, dev: Device) -> None:
    """nvidia's remove(): refuse while in use (a real kernel blocks), then drop the device's vGPUs."""
    if usage_count(state, dev) > 0 and not dev.unbind_lock:
        raise kernel_error(
            errno.EBUSY,
            f"{dev.address}: non-zero usage count (real nv_pci_remove waits forever); take unbindLock first",
        )
    mine = [m for m in state.mdevs.values() if m.parent == dev.address]
    if any(h.kind == "mdev" and h.target in {m.uuid for m in mine} for h in state.handles):
        raise kernel_error(errno.EBUSY, f"{dev.address}: an mdev on it is open by a VM")
    if dev.vgpu_type and any(h.kind == "vfio" and h.target == dev.address for h in state.handles):
        raise kernel_error(errno.EBUSY, f"{dev.address}: its vGPU is open by a VM")
    for mdev in mine:
        del state.mdevs[mdev.uuid]
    dev.vgpu_type = 0  # the VF's VFIO device goes with the driver (detach clears vfio_index)


def teardown_vgpu_manager(state: KernelState) -> None:
    """``nvidia_vgpu_vfio`` unloads: every mdev and vendor vGPU goes (the module refcount proved none is
    open)."""
    state.mdevs.clear()
    for dev in state.devices.values():
        if dev.vgpu_type:
            dev.vgpu_type = 0
            dev.vfio_index = None


def write_unbind_lock(state: KernelState, dev: Device, value: str) -> None:
    """``unbindLock`` ← 1 takes the lock only when no client holds the GPU (read back to check); 0
    releases."""
    try:
        wanted = kstrtoul(value, 10)
    except ValueError:
        raise kernel_error(errno.EINVAL, f"unbindLock expects 0 or 1, got {value!r}") from None
    dev.unbind_lock = bool(wanted) and usage_count(state, dev) == 0


# --- /proc/driver/nvidia ------------------------------------------------------------------------------------


def version_text(version: str, build: str) -> str:
    if build == "open":
        nvrm = f"NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  "
        nvrm += "(dvs-builder@U16-I3-B03-4-3)  Tue Mar  5 23:54:46 UTC 2024"
    else:
        nvrm = f"NVIDIA UNIX x86_64 Kernel Module  {version}  Wed Jun  5 21:37:31 UTC 2024"
    return f"NVRM version: {nvrm}\nGCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04) \n"


def params_text() -> str:
    return 'ResmanDebugLevel: 4294967295\nEnableMSI: 1\nModifyDeviceFiles: 1\nRegistryDwords: ""\n'


def information_text(state: KernelState, dev: Device, minor: int) -> str:
    d, b, s, f = _split(dev.address)
    return (
        f"Model: \t\t {model_name(dev.vendor, dev.device)}\n"
        f"IRQ:   \t\t {dev.irq}\n"
        f"GPU UUID: \t {dev.gpu_uuid}\n"
        "Video BIOS: \t 96.00.99.00.01\n"
        "Bus Type: \t PCIe\n"
        "DMA Size: \t 52 bits\n"
        "DMA Mask: \t 0xfffffffffffff\n"
        f"Bus Location: \t {d:04x}:{b:02x}:{s:02x}.{f:x}\n"
        f"Device Minor: \t {minor}\n"
        "GPU Excluded:\t No\n"
    )


def _split(address: str) -> tuple[int, int, int, int]:
    dom, bus, rest = address.split(":")
    slot, func = rest.split(".")
    return int(dom, 16), int(bus, 16), int(slot, 16), int(func, 16)


@lru_cache(maxsize=1)
def _nvidia_names() -> dict[int, str]:
    """Device names of vendor 10de from the vendored pci.ids ("GH100 [H100 SXM5 80GB]" → "H100 SXM5 80GB")."""
    names: dict[int, str] = {}
    raw = resources.files("gpumode").joinpath("data/pci.ids").read_bytes()
    text = raw.decode("utf-8", errors="replace")
    inside = False
    for line in text.splitlines():
        if line.startswith("10de "):
            inside = True
            continue
        if inside:
            if line and not line.startswith(("\t", "#")):
                break
            if line.startswith("\t") and not line.startswith("\t\t"):
                dev_id, _, name = line.strip().partition(" ")
                bracket = re.search(r"\[(.+)\]", name)
                names[int(dev_id, 16)] = (bracket.group(1) if bracket else name).strip()
    return names


def model_name(vendor: int, device: int) -> str:
    """What ``information`` prints as ``Model:``."""
    name = _nvidia_names().get(device) if vendor == 0x10DE else None
    return f"NVIDIA {name}" if name else f"NVIDIA Device {device:04x}"
