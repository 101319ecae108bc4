"""vGPU devices under NVIDIA's vGPU manager, through both interfaces it has had.

* **mdev** (vGPU ≤16): a parent (the GPU, or its SR-IOV VFs on Ampere) lists
  ``mdev_supported_types/nvidia-N``; writing a UUID to ``create`` makes a vGPU, writing 1 to ``<uuid>/remove``
  destroys it. Like mdevctl we also write ``/etc/mdevctl.d/<parent>/<uuid>`` so mdevctl's udev rule recreates
  it at boot.
* **vendor VFIO** (vGPU 17+): after ``sriov-manage -e``, each VF has ``nvidia/creatable_vgpu_types`` and
  ``nvidia/current_vgpu_type``; writing a type id there turns the VF itself into the vGPU.

SR-IOV is switched with NVIDIA's ``sriov-manage`` rather than by writing ``sriov_numvfs``: the nvidia driver
has no ``sriov_configure``, so the PF has to pass through pci-pf-stub — which is what that script does.
"""

from __future__ import annotations

import json
import os
import re
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpumode.domain import Mdev, MdevType, PciAddressError, normalize_address
from gpumode.host.holders import (
    DeviceHeld,
    blocking_write,
    mdev_device_files,
    pci_device_files,
    refuse_if_held,
)
from gpumode.host.root import CommandError, Host

SRIOV_MANAGE = "/usr/lib/nvidia/sriov-manage"


class VgpuError(RuntimeError):
    """A vGPU operation was refused or did not take effect; the message names the device and the way out."""


# --- helpers ------------------------------------------------------------------------------------------------


def _device(host: Host, address: str) -> tuple[str, Path]:
    try:
        address = normalize_address(address)
    except PciAddressError as exc:
        raise VgpuError(str(exc)) from exc
    path = host.path("sys/bus/pci/devices", address)
    if not path.exists():
        raise VgpuError(f"no PCI device {address} on {host}")
    return address, path


def _read_int(path: Path) -> int:
    return int(path.read_text().strip(), 0)


def _write(host: Host, path: Path, value: str, what: str) -> None:
    try:
        host.write(path, value)
    except OSError as exc:
        raise VgpuError(f"{what} failed: {exc.strerror} ({host.relative(path)})") from exc


# --- SR-IOV -------------------------------------------------------------------------------------------------


def _sriov_pf(host: Host, pf: str) -> tuple[str, Path]:
    address, path = _device(host, pf)
    if not (path / "sriov_totalvfs").exists():
        raise VgpuError(f"{address} has no SR-IOV capability (no sriov_totalvfs): it is not an SR-IOV GPU")
    return address, path


def list_vfs(host: Host, pf: str) -> list[str]:
    """The PF's enabled VFs in ``virtfnN`` order."""
    _, path = _device(host, pf)
    links = [(int(name[6:]), name) for name in os.listdir(path) if re.fullmatch(r"virtfn\d+", name)]
    return [os.path.basename(os.readlink(path / name)) for _, name in sorted(links)]


def num_vfs(host: Host, pf: str) -> int:
    """The PF's ``sriov_numvfs``."""
    _, path = _sriov_pf(host, pf)
    try:
        return _read_int(path / "sriov_numvfs")
    except (OSError, ValueError) as exc:
        raise VgpuError(f"cannot read {host.relative(path / 'sriov_numvfs')}: {exc}") from exc


def virtfn(host: Host, pf: str, index: int) -> str | None:
    """The address of the PF's VF number ``index`` (its ``virtfnN`` link); None while it does not exist."""
    link = _device(host, pf)[1] / f"virtfn{index}"
    return os.path.basename(os.readlink(link)) if os.path.islink(link) else None


def refuse_if_vfs_held(host: Host, pf: str) -> None:
    """Raise :class:`VgpuError` naming the processes holding any of the PF's VFs (disabling would wait)."""
    address, _ = _device(host, pf)
    try:
        for vf in list_vfs(host, address):
            refuse_if_held(host, vf, pci_device_files(host, vf))
    except DeviceHeld as exc:
        raise VgpuError(f"cannot disable the VFs of {address}: {exc}") from exc


def vfs_enabled(host: Host, pf: str) -> bool:
    _, path = _sriov_pf(host, pf)
    return _read_int(path / "sriov_numvfs") > 0


def _verify_vfs(host: Host, pf: str, expected: int, after: str) -> list[str]:
    """The kernel's own account after an SR-IOV change: ``sriov_numvfs`` and one present VF per
    ``virtfnN`` link must both say ``expected``; anything else is a failure, whatever the exit code said."""
    address, path = _sriov_pf(host, pf)
    numvfs = _read_int(path / "sriov_numvfs")
    vfs = list_vfs(host, address)
    present = [vf for vf in vfs if host.path("sys/bus/pci/devices", vf).exists()]
    if numvfs != expected or len(present) != expected:
        raise VgpuError(
            f"{after}: {address} reads sriov_numvfs={numvfs} with {len(present)} VF(s) present, "
            f"not {expected}"
        )
    return vfs


def write_numvfs(host: Host, pf: str, count: int) -> list[str]:
    """Set the PF's VF count through ``sriov_numvfs`` (a PF whose driver has ``sriov_configure``: a NIC, an
    NVMe controller, pci-pf-stub) and verify it by reading the kernel's state back; returns the VFs.

    The kernel refuses n→m without going through 0 (EBUSY), so a different non-zero count disables first.
    Disabling waits for every VF's driver to let go, so it is refused while a process holds a VF.
    """
    address, path = _sriov_pf(host, pf)
    total = _read_int(path / "sriov_totalvfs")
    if not 0 <= count <= total:
        raise VgpuError(f"{address} supports 0 to {total} VFs, not {count}")
    current = _read_int(path / "sriov_numvfs")
    if current == count:
        return _verify_vfs(host, address, count, f"{address} already has {count} VF(s)")
    numvfs = path / "sriov_numvfs"
    if current:
        files = [f for vf in list_vfs(host, address) for f in pci_device_files(host, vf)]
        try:
            blocking_write(host, numvfs, "0", what=f"the VFs of {address}", files=files)
        except DeviceHeld as exc:
            raise VgpuError(f"cannot disable {exc}") from exc
        except OSError as exc:
            raise VgpuError(f"disabling the VFs of {address} failed: {exc.strerror}") from exc
        _verify_vfs(host, address, 0, f"writing 0 to sriov_numvfs of {address}")
    if count:
        _write(host, numvfs, str(count), f"enabling {count} VF(s) on {address}")
    return _verify_vfs(host, address, count, f"writing {count} to sriov_numvfs of {address}")


def enable_vfs(host: Host, pf: str) -> list[str]:
    """Enable the GPU's VFs with ``sriov-manage -e``; returns them. Already enabled: nothing runs."""
    address, _ = _sriov_pf(host, pf)
    if not vfs_enabled(host, address):
        try:
            host.run([SRIOV_MANAGE, "-e", address], check=True)
        except CommandError as exc:
            raise VgpuError(f"enabling VFs on {address} failed: {exc}") from exc
        # sriov-manage exits 0 without doing anything on a GPU it does not consider vGPU-capable.
        if not vfs_enabled(host, address):
            raise VgpuError(
                f"sriov-manage -e {address} enabled no VFs: is the vGPU manager (not the data-center driver) "
                "loaded and bound to this GPU?"
            )
    _, path = _sriov_pf(host, address)
    return _verify_vfs(host, address, _read_int(path / "sriov_numvfs"), f"sriov-manage -e {address}")


def disable_vfs(host: Host, pf: str) -> None:
    """Disable the GPU's VFs with ``sriov-manage -d``. Refuses while a VF still carries a vGPU."""
    address, _ = _sriov_pf(host, pf)
    if not vfs_enabled(host, address):
        return
    busy = [vf for vf in list_vfs(host, address) if _vf_busy(host, vf)]
    if busy:
        raise VgpuError(f"VFs of {address} still carry vGPUs ({', '.join(busy)}): remove the vGPUs first")
    refuse_if_vfs_held(host, address)  # sriov-manage writes sriov_numvfs=0, which waits for every VF's users
    try:
        host.run([SRIOV_MANAGE, "-d", address], check=True)
    except CommandError as exc:
        raise VgpuError(f"disabling VFs on {address} failed: {exc}") from exc
    _verify_vfs(host, address, 0, f"sriov-manage -d {address}")


def _vf_busy(host: Host, vf: str) -> bool:
    return bool(current_type(host, vf)) if has_vendor_interface(host, vf) else bool(_mdevs_on(host, vf))


# --- mdev ---------------------------------------------------------------------------------------------------


def _mdev_parent(host: Host, parent: str) -> tuple[str, Path]:
    """A PCI function (a GPU or VF), or any other registered mdev parent by its ``class/mdev_bus`` name
    (the kernel's sample drivers register ``mtty`` and ``mdpy``)."""
    try:
        return _device(host, parent)
    except VgpuError:
        path = host.path("sys/class/mdev_bus", parent)
        if "/" in parent or not parent or not path.exists():
            raise
        return parent, path


def _types_dir(host: Host, parent: str) -> Path:
    return _mdev_parent(host, parent)[1] / "mdev_supported_types"


def is_mdev_parent(host: Host, address: str) -> bool:
    return _types_dir(host, address).is_dir()


def mdev_parents(host: Host, gpu: str) -> list[str]:
    """Where vGPUs of ``gpu`` are created: its VFs when they are mdev parents (Ampere SR-IOV), else the GPU
    itself when it is one (pre-Ampere), else nothing (no vGPU manager, or a vendor-VFIO GPU)."""
    address, _ = _device(host, gpu)
    vf_parents = [vf for vf in list_vfs(host, address) if is_mdev_parent(host, vf)]
    if vf_parents:
        return vf_parents
    return [address] if is_mdev_parent(host, address) else []


def supported_types(host: Host, parent: str) -> list[MdevType]:
    """The parent's ``mdev_supported_types``, sorted by type id."""
    types_dir = _types_dir(host, parent)
    if not types_dir.is_dir():
        return []
    types = []
    for entry in sorted(types_dir.iterdir(), key=lambda p: _type_sort_key(p.name)):
        description = entry / "description"
        types.append(
            MdevType(
                type_id=entry.name,
                name=(entry / "name").read_text().strip() if (entry / "name").exists() else entry.name,
                description=description.read_text().strip() if description.exists() else "",
                available_instances=_read_int(entry / "available_instances"),
                device_api=(entry / "device_api").read_text().strip(),
            )
        )
    return types


def _type_sort_key(type_id: str) -> tuple[int, str]:
    number = type_id.rsplit("-", 1)[-1]
    return (int(number), type_id) if number.isdigit() else (1 << 30, type_id)


def list_mdevs(host: Host) -> list[Mdev]:
    """Every active mdev (``sys/bus/mdev/devices``), with its parent and type."""
    bus = host.path("sys/bus/mdev/devices")
    if not bus.is_dir():
        return []
    mdevs = []
    for name in sorted(os.listdir(bus)):
        link = bus / name
        parent = os.path.basename(os.path.dirname(os.path.normpath(os.path.join(bus, os.readlink(link)))))
        type_id = os.path.basename(os.readlink(link / "mdev_type")) if (link / "mdev_type").exists() else ""
        mdevs.append(Mdev(uuid=name, type_id=type_id, parent=parent))
    return mdevs


def mdev_exists(host: Host, uuid: str) -> bool:
    return host.path("sys/bus/mdev/devices", uuid).exists()


def _mdevs_on(host: Host, parent: str) -> list[Mdev]:
    return [m for m in list_mdevs(host) if m.parent == parent]


def _uuid(value: str | None) -> str:
    if value is None:
        return str(uuidlib.uuid4())
    try:
        return str(uuidlib.UUID(value))
    except ValueError:
        raise VgpuError(f"not a UUID: {value!r}") from None


def mdev_persistence_file(host: Host, parent: str, mdev_uuid: str) -> Path:
    return host.path("etc/mdevctl.d", parent, mdev_uuid)


def create_mdev(
    host: Host, parent: str, type_id: str, uuid: str | None = None, *, persist: bool = True
) -> str:
    """Create a vGPU of ``type_id`` on ``parent``; returns its UUID. Idempotent for an existing UUID of the
    same parent and type. With ``persist`` it is also defined for mdevctl (``start: auto``): back at boot."""
    parent, _ = _mdev_parent(host, parent)
    mdev_uuid = _uuid(uuid)
    existing = {m.uuid: m for m in list_mdevs(host)}.get(mdev_uuid)
    if existing is not None:
        if (existing.parent, existing.type_id) != (parent, type_id):
            raise VgpuError(
                f"mdev {mdev_uuid} already exists as {existing.type_id} on {existing.parent}, "
                f"not {type_id} on {parent}"
            )
    else:
        offered = {t.type_id: t for t in supported_types(host, parent)}
        if type_id not in offered:
            names = ", ".join(f"{t.type_id} ({t.name})" for t in offered.values()) or "none"
            raise VgpuError(f"{parent} does not offer vGPU type {type_id}; it offers: {names}")
        if offered[type_id].available_instances < 1:
            raise VgpuError(
                f"no {type_id} ({offered[type_id].name}) instance left on {parent}: it is full, or already "
                "carries vGPUs of another type"
            )
        _write(host, _types_dir(host, parent) / type_id / "create", mdev_uuid, f"creating mdev {mdev_uuid}")
        if not host.path("sys/bus/mdev/devices", mdev_uuid).exists():
            raise VgpuError(f"writing {mdev_uuid} to {type_id}/create on {parent} created no device")
    if persist:
        path = mdev_persistence_file(host, parent, mdev_uuid)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"mdev_type": type_id, "start": "auto", "attrs": []}, indent=2) + "\n")
    return mdev_uuid


def remove_mdev(host: Host, uuid: str) -> None:
    """Destroy an mdev and forget its mdevctl definition. Absent: only the definition is removed.

    The kernel's remove waits for the mdev's users, so it is refused while a process (a VM) holds it."""
    mdev_uuid = _uuid(uuid)
    device = host.path("sys/bus/mdev/devices", mdev_uuid)
    if device.exists():
        try:
            files = mdev_device_files(host, mdev_uuid)
            blocking_write(host, device / "remove", "1", what=f"mdev {mdev_uuid}", files=files)
        except DeviceHeld as exc:
            raise VgpuError(f"cannot remove {exc}") from exc
        except OSError as exc:
            raise VgpuError(f"removing mdev {mdev_uuid} failed: {exc.strerror}") from exc
        if device.exists():
            raise VgpuError(f"writing 1 to remove of mdev {mdev_uuid} left the device in place")
    for path in host.path("etc/mdevctl.d").glob(f"*/{mdev_uuid}"):
        path.unlink()
        if not any(path.parent.iterdir()):
            path.parent.rmdir()


# --- vendor VFIO interface (vGPU 17+) -----------------------------------------------------------------------


def _nvidia_dir(host: Host, vf: str) -> Path:
    return _device(host, vf)[1] / "nvidia"


def has_vendor_interface(host: Host, vf: str) -> bool:
    return (_nvidia_dir(host, vf) / "current_vgpu_type").exists()


def _vendor_dir(host: Host, vf: str) -> Path:
    path = _nvidia_dir(host, vf)
    if not (path / "current_vgpu_type").exists():
        raise VgpuError(
            f"{normalize_address(vf)} has no nvidia/current_vgpu_type: not a VF of a vGPU 17+ host "
            "(enable VFs with the vGPU manager loaded)"
        )
    return path


_CREATABLE_LINE = re.compile(r"^\s*(\d+)\s*:\s*(.+?)\s*$")


def parse_creatable(text: str) -> dict[int, str]:
    """Parse ``creatable_vgpu_types``: a header ``ID    : vGPU Name`` then ``%-5d : %s`` lines."""
    types: dict[int, str] = {}
    for line in text.splitlines():
        m = _CREATABLE_LINE.match(line)
        if m:
            types[int(m.group(1))] = m.group(2)
    return types


def creatable_types(host: Host, vf: str) -> dict[int, str]:
    """The vGPU types this VF can take right now (the list shrinks as sibling VFs get types)."""
    return parse_creatable((_vendor_dir(host, vf) / "creatable_vgpu_types").read_text())


def current_type(host: Host, vf: str) -> int:
    """The VF's vGPU type id; 0 when it has none."""
    return _read_int(_vendor_dir(host, vf) / "current_vgpu_type")


def set_vgpu_type(host: Host, vf: str, type_id: int) -> None:
    """Make the VF a vGPU of ``type_id``. Same type already: no-op; another type: refused (clear it first)."""
    vf, _ = _device(host, vf)
    current = current_type(host, vf)
    if current == type_id:
        return
    if current:
        raise VgpuError(f"{vf} already is a vGPU of type {current}: clear it before setting {type_id}")
    creatable = creatable_types(host, vf)
    if type_id not in creatable:
        names = ", ".join(f"{i} ({n})" for i, n in sorted(creatable.items())) or "none"
        raise VgpuError(f"{vf} cannot take vGPU type {type_id} now; creatable: {names}")
    path = _vendor_dir(host, vf) / "current_vgpu_type"
    _write(host, path, str(type_id), f"setting vGPU type {type_id} on {vf}")


def clear_vgpu_type(host: Host, vf: str) -> None:
    """Remove the VF's vGPU (write 0). None set: no-op (the driver would answer EPERM)."""
    vf, _ = _device(host, vf)
    if current_type(host, vf) == 0:
        return
    path = _vendor_dir(host, vf) / "current_vgpu_type"
    _write(host, path, "0", f"clearing the vGPU of {vf} (is a VM still using it?)")


# --- type resolution ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VgpuType:
    """A vGPU type as one GPU offers it, under the interface that GPU uses."""

    interface: Literal["mdev", "vendor"]
    type_id: int  # NVML type id
    name: str  # "NVIDIA L40S-4Q"

    @property
    def mdev_type(self) -> str:
        """The mdev type directory name, ``nvidia-<id>``."""
        return f"nvidia-{self.type_id}"

    @property
    def short_name(self) -> str:
        """The name without its vendor prefix (``L40S-4Q``), as vgpu-device-manager configs spell it."""
        return self.name.split()[-1]


def offered_types(host: Host, gpu: str) -> list[VgpuType]:
    """Every vGPU type the GPU offers now, under either interface, sorted by id."""
    address, _ = _device(host, gpu)
    found: dict[int, VgpuType] = {}
    for parent in mdev_parents(host, address):
        for t in supported_types(host, parent):
            number = t.type_id.rsplit("-", 1)[-1]
            if number.isdigit():
                found.setdefault(int(number), VgpuType("mdev", int(number), t.name))
    for vf in list_vfs(host, address):
        if has_vendor_interface(host, vf):
            for type_id, name in creatable_types(host, vf).items():
                found.setdefault(type_id, VgpuType("vendor", type_id, name))
    return [found[k] for k in sorted(found)]


def resolve_vgpu_type(host: Host, gpu: str, name_or_id: str | int) -> VgpuType:
    """The type ``name_or_id`` means on this GPU: a full name (``NVIDIA L40S-4Q``), a short one (``L40S-4Q``),
    an mdev type (``nvidia-1150``) or a bare id (``1150``). Case does not matter."""
    offered = offered_types(host, gpu)
    if not offered:
        raise VgpuError(
            f"GPU {normalize_address(gpu)} offers no vGPU types: the vGPU manager must be loaded and, on "
            "SR-IOV GPUs, the VFs enabled"
        )
    wanted = str(name_or_id).strip()
    key = wanted.lower()
    number = key.removeprefix("nvidia-")
    for t in offered:
        if number.isdigit() and int(number) == t.type_id:
            return t
        if key in (t.name.lower(), t.short_name.lower()):
            return t
    listing = ", ".join(f"{t.name} ({t.type_id})" for t in offered)
    raise VgpuError(f"GPU {normalize_address(gpu)} has no vGPU type {wanted!r}; it offers: {listing}")
