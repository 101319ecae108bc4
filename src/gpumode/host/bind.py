"""Moving a GPU, with its whole IOMMU group, to vfio-pci and back — the way driverctl and libvirt do it.

Why this shape:

* A VM can only open a VFIO group when *every* member is on a VFIO driver (or unbound). Moving just the GPU
  leaves QEMU failing with "group N is not viable", so the unit of work is the group plus the GPU's
  ``consumer:pci:`` functions (the HDMI audio of a VGA board). Bridges stay on their driver: pcieport is
  DMA-compatible with a user-owned group.
* ``driver_override`` + unbind + ``drivers_probe`` binds exactly the device named, unlike ``new_id`` which
  grabs every unbound device with that ID. ``drivers_probe`` reports success even when nothing bound, so the
  ``driver`` link is re-read after each probe.
* ``nvidia``'s remove() blocks forever while clients hold the GPU; taking its ``unbindLock`` first turns that
  hang into a clear error.
* An override lives in memory only; ``/etc/driverctl.d/pci-<BDF>`` makes driverctl's udev rule re-apply it at
  boot.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Mapping
from pathlib import Path

from gpumode.domain import PciAddressError, normalize_address
from gpumode.host.driverops import service_active
from gpumode.host.holders import DeviceHeld, blocking_write, pci_device_files, refuse_if_held
from gpumode.host.root import CommandError, Host

VFIO_DRIVER = "vfio-pci"
VFIO_MODULE = "vfio_pci"

# Services that keep /dev/nvidia* open on a GPU host; named in errors when the unbindLock cannot be taken.
GPU_CLIENT_SERVICES = (
    "nvidia-persistenced",
    "nvidia-fabricmanager",
    "nvidia-dcgm",
    "dcgm-exporter",
    "nvidia-vgpu-mgr",
    "nvidia-vgpud",
)

# Host, PCI-to-PCI and semi-transparent bridges never move to vfio-pci (pcieport is VFIO-compatible).
_BRIDGE_CLASSES = frozenset({0x0600, 0x0604, 0x0609})


class BindError(RuntimeError):
    """A driver binding could not be changed; the message names the device and what to do."""


# --- reading ------------------------------------------------------------------------------------------------


def device_dir(host: Host, address: str) -> Path:
    """The sysfs directory of a PCI function; raises :class:`BindError` for a bad or absent address."""
    try:
        address = normalize_address(address)
    except PciAddressError as exc:
        raise BindError(str(exc)) from exc
    path = host.path("sys/bus/pci/devices", address)
    if not path.exists():
        raise BindError(f"no PCI device {address} on {host}")
    return path


def device_exists(host: Host, address: str) -> bool:
    """Whether the PCI function is present (a bad address is simply absent)."""
    try:
        return host.path("sys/bus/pci/devices", normalize_address(address)).exists()
    except PciAddressError:
        return False


def current_driver(host: Host, address: str) -> str | None:
    """The driver bound to ``address`` (basename of its ``driver`` link), or None when unbound."""
    link = device_dir(host, address) / "driver"
    if not os.path.islink(link):
        return None
    return os.path.basename(os.readlink(link))


def driver_override(host: Host, address: str) -> str | None:
    """The device's ``driver_override``; the kernel prints ``(null)`` when none is set."""
    path = device_dir(host, address) / "driver_override"
    if not path.exists():
        return None
    value = path.read_text().strip()
    return None if value in ("", "(null)") else value


def _class_code(path: Path) -> int | None:
    try:
        return int((path / "class").read_text().strip(), 16)
    except (OSError, ValueError):
        return None


def is_bridge(host: Host, address: str) -> bool:
    code = _class_code(device_dir(host, address))
    return code is not None and (code >> 8) in _BRIDGE_CLASSES


def iommu_group(host: Host, address: str) -> int | None:
    """The IOMMU group number of ``address``; None when the host has no IOMMU (no ``iommu_group`` link)."""
    link = device_dir(host, address) / "iommu_group"
    if not os.path.islink(link):
        return None
    return int(os.path.basename(os.readlink(link)))


def consumers(host: Host, address: str) -> list[str]:
    """Functions linked to ``address`` as ``consumer:pci:<BDF>`` (a VGA function's HDMI audio)."""
    prefix = "consumer:pci:"
    path = device_dir(host, address)
    return sorted(name[len(prefix) :] for name in os.listdir(path) if name.startswith(prefix))


def iommu_group_members(host: Host, address: str) -> list[str]:
    """Every function that must move with ``address``: its IOMMU group and its consumer links (sorted, itself
    included). Without an IOMMU it is just the device and its consumers (vfio-pci would refuse it anyway)."""
    address = device_dir(host, address).name
    members = {address, *consumers(host, address)}
    group = iommu_group(host, address)
    if group is not None:
        devices = host.path("sys/kernel/iommu_groups", str(group), "devices")
        if devices.is_dir():
            members.update(os.listdir(devices))
    for member in list(members):
        if host.path("sys/bus/pci/devices", member).exists():
            members.update(consumers(host, member))
    return sorted(members)


def vfio_members(host: Host, address: str) -> list[str]:
    """The group members that go to vfio-pci: all of them but bridges."""
    return [m for m in iommu_group_members(host, address) if not is_bridge(host, m)]


def is_bound_to_vfio(host: Host, address: str) -> bool:
    """True when every non-bridge function of the GPU's group is bound to vfio-pci (the group is VM-ready)."""
    return all(current_driver(host, m) == VFIO_DRIVER for m in vfio_members(host, address))


def persistence_file(host: Host, address: str) -> Path:
    """driverctl's override file for a PCI function: its content is the driver name."""
    return host.path("etc/driverctl.d", f"pci-{normalize_address(address)}")


def persisted_override(host: Host, address: str) -> str | None:
    path = persistence_file(host, address)
    return path.read_text().strip() or None if path.exists() else None


# --- nvidia -------------------------------------------------------------------------------------------------


def unbind_lock_path(host: Host, address: str) -> Path:
    return host.path("proc/driver/nvidia/gpus", normalize_address(address), "unbindLock")


def release_from_nvidia(host: Host, address: str) -> None:
    """Unbind an nvidia-bound GPU after taking its ``unbindLock`` (as ``sriov-manage`` does).

    The lock only succeeds when no client holds the GPU; without it, ``nvidia/unbind`` would block until the
    last client goes away; the error names the GPU client services found running. A GPU not bound to nvidia is
    left alone.
    """
    address = device_dir(host, address).name
    if current_driver(host, address) != "nvidia":
        return
    lock = unbind_lock_path(host, address)
    if lock.exists():
        try:
            host.write(lock, "1")
            taken = lock.read_text().strip() == "1"
        except OSError as exc:
            raise BindError(f"cannot take the nvidia unbindLock of {address}: {exc.strerror}") from exc
        if not taken:
            active = [unit for unit in GPU_CLIENT_SERVICES if service_active(host, unit)]
            running = "running services: " + ", ".join(active) if active else "no known GPU service runs"
            raise BindError(
                f"GPU {address} is in use, nvidia refuses to release it (unbindLock stays 0): stop its "
                f"clients first ({running}; `fuser -v /dev/nvidia*` lists the processes)"
            )
    try:
        host.write(host.path("sys/bus/pci/drivers/nvidia/unbind"), address)
    except OSError as exc:
        if lock.exists():
            _release_lock(host, lock)
        raise BindError(f"unbinding {address} from nvidia failed: {exc.strerror}") from exc


def _release_lock(host: Host, lock: Path) -> None:
    with contextlib.suppress(OSError):  # best effort: the real failure is being reported
        host.write(lock, "0")


# --- binding ------------------------------------------------------------------------------------------------


def ensure_vfio_driver(host: Host) -> None:
    """Load vfio-pci when its driver directory is missing (libvirt's ``virPCIProbeDriver``)."""
    driver_dir = host.path("sys/bus/pci/drivers", VFIO_DRIVER)
    if driver_dir.is_dir():
        return
    try:
        host.run(["modprobe", VFIO_DRIVER], check=True)
    except CommandError as exc:
        raise BindError(f"cannot load vfio-pci: {exc}") from exc
    if not driver_dir.is_dir():
        raise BindError(f"modprobe vfio-pci succeeded but {host.relative(driver_dir)} did not appear")


def unbind(host: Host, address: str, driver: str) -> None:
    """Unbind ``address`` from ``driver`` (refused while a process holds it; see :func:`_unbind`)."""
    _unbind(host, device_dir(host, address).name, driver)


def driver_registered(host: Host, driver: str) -> bool:
    """Whether a PCI driver of that name is registered (its module loaded, or built in)."""
    return "/" not in driver and host.path("sys/bus/pci/drivers", driver).is_dir()


def bind_driver(host: Host, address: str, driver: str) -> None:
    """Bind ``address`` to ``driver`` through ``drivers/<driver>/bind`` and check the link afterwards."""
    address = device_dir(host, address).name
    try:
        host.write(host.path("sys/bus/pci/drivers", driver, "bind"), address)
    except OSError as exc:
        raise BindError(f"binding {address} to {driver} failed: {exc.strerror}") from exc
    if current_driver(host, address) != driver:
        now = current_driver(host, address) or "none"
        raise BindError(f"binding {address} to {driver} returned, but its driver is {now}")


def probe(host: Host, address: str) -> str | None:
    """Let the kernel pick a driver for ``address`` (``drivers_probe``); returns the driver it got, if any."""
    address = device_dir(host, address).name
    _probe(host, address)
    return current_driver(host, address)


def _unbind(host: Host, address: str, driver: str) -> None:
    """Unbind, refusing while a process holds the device: a VFIO driver's remove() waits for its users."""
    try:
        blocking_write(
            host,
            host.path("sys/bus/pci/drivers", driver, "unbind"),
            address,
            what=f"{address} (on {driver})",
            files=pci_device_files(host, address),
        )
    except DeviceHeld as exc:
        raise BindError(f"cannot unbind {exc}") from exc
    except OSError as exc:
        raise BindError(f"unbinding {address} from {driver} failed: {exc.strerror}") from exc


def _set_override(host: Host, address: str, value: str) -> None:
    try:
        host.write(device_dir(host, address) / "driver_override", value)
    except OSError as exc:
        raise BindError(f"cannot set driver_override of {address}: {exc.strerror}") from exc


def _probe(host: Host, address: str) -> None:
    try:
        host.write(host.path("sys/bus/pci/drivers_probe"), address)
    except OSError as exc:
        raise BindError(f"probing drivers for {address} failed: {exc.strerror}") from exc


def _check_can_bind(host: Host, address: str, members: list[str]) -> None:
    """Refuse before changing anything when the move would destroy vGPU state or cannot work."""
    if iommu_group(host, address) is None:
        raise BindError(f"{address} has no IOMMU group: enable the IOMMU (intel_iommu=on, amd_iommu=on)")
    for member in members:
        path = device_dir(host, member)
        numvfs = path / "sriov_numvfs"
        if numvfs.exists() and numvfs.read_text().strip() not in ("", "0"):
            raise BindError(f"{member} has SR-IOV VFs enabled: disable them (vGPU mode) before passthrough")
        mdevs = sorted(p.name for p in path.iterdir() if (p / "mdev_type").exists())
        if mdevs:
            raise BindError(f"{member} still carries vGPU devices {', '.join(mdevs)}: remove them first")


def bind_to_vfio(host: Host, address: str, *, persist: bool = True) -> dict[str, str | None]:
    """Bind every non-bridge function of ``address``'s IOMMU group to vfio-pci.

    Returns what each function was bound to before (None: unbound), which :func:`release_from_vfio` takes to
    undo. Functions already on vfio-pci are left as they are. With ``persist`` the overrides are written to
    ``/etc/driverctl.d`` so they hold across a reboot. If a function fails to bind, the ones already moved are
    put back before the error is raised.
    """
    address = device_dir(host, address).name
    members = vfio_members(host, address)
    _check_can_bind(host, address, members)
    before = {m: current_driver(host, m) for m in members}
    ensure_vfio_driver(host)
    moved: list[str] = []
    try:
        for member in members:
            if before[member] == VFIO_DRIVER and driver_override(host, member) == VFIO_DRIVER:
                continue
            moved.append(member)
            if before[member] == "nvidia":
                release_from_nvidia(host, member)
            _set_override(host, member, VFIO_DRIVER)
            bound = current_driver(host, member)
            if bound not in (None, VFIO_DRIVER):
                _unbind(host, member, bound)
            if bound != VFIO_DRIVER:
                _probe(host, member)
            now = current_driver(host, member)
            if now != VFIO_DRIVER:
                raise BindError(f"{member} did not bind to vfio-pci (driver now: {now or 'none'})")
    except BindError:
        _undo(host, {m: before[m] for m in moved})
        raise
    if persist:
        for member in members:
            _persist(host, member, VFIO_DRIVER)
    return before


def release_from_vfio(host: Host, address: str, drivers: Mapping[str, str | None]) -> dict[str, str | None]:
    """Give ``address``'s group back to host drivers: clear each override, unbind from vfio-pci, reprobe.

    ``drivers`` is what :func:`bind_to_vfio` returned: a function is bound back to its recorded driver when
    that driver is loaded, else left to the kernel's probe (an unloaded driver picks it up when it loads). The
    driverctl files are removed. Returns the driver of each function afterwards.
    """
    address = device_dir(host, address).name
    try:
        recorded = {normalize_address(k): v for k, v in drivers.items()}
    except PciAddressError as exc:
        raise BindError(f"bad address in recorded drivers: {exc}") from exc
    members = sorted(set(vfio_members(host, address)) | set(recorded))
    for member in members:
        device_dir(host, member)  # every one must exist before we touch any
    for member in members:
        try:
            refuse_if_held(host, member, pci_device_files(host, member))
        except DeviceHeld as exc:
            raise BindError(f"cannot release {address}'s group from vfio-pci: {exc}") from exc
    _undo(host, {m: recorded.get(m) for m in members})
    return {m: current_driver(host, m) for m in members}


def _undo(host: Host, drivers: Mapping[str, str | None]) -> None:
    """Put each function back on its recorded driver (or the kernel's choice) and drop its persistence.

    The whole group leaves vfio-pci before any function is probed again: a real kernel refuses a host driver
    for a function while another member of its IOMMU group is still on vfio-pci.
    """
    for member in drivers:
        if driver_override(host, member) is not None:
            _set_override(host, member, "\n")
        if current_driver(host, member) == VFIO_DRIVER:
            _unbind(host, member, VFIO_DRIVER)
    for member, wanted in drivers.items():
        if wanted not in (None, VFIO_DRIVER) and host.path("sys/bus/pci/drivers", wanted).is_dir():
            if current_driver(host, member) is None:
                try:
                    host.write(host.path("sys/bus/pci/drivers", wanted, "bind"), member)
                except OSError as exc:
                    hint = " (a VM still holds its IOMMU group)" if exc.errno == errno.EBUSY else ""
                    raise BindError(
                        f"binding {member} back to {wanted} failed: {exc.strerror}{hint}"
                    ) from exc
        elif current_driver(host, member) is None:
            _probe(host, member)
        _unpersist(host, member)


def _persist(host: Host, address: str, driver: str) -> None:
    path = persistence_file(host, address)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(driver + "\n")


def _unpersist(host: Host, address: str) -> None:
    persistence_file(host, address).unlink(missing_ok=True)
