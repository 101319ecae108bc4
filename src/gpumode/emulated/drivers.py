"""The PCI driver core: matching, probe, bind/unbind, autoprobe, dynamic ids, IOMMU-group DMA ownership.

Mirrors ``drivers/base/{bus,dd}.c`` and ``drivers/pci/pci-driver.c`` closely enough that the same sequence of
writes (libvirt's, driverctl's, sriov-manage's, go-nvlib's) gives the same result and the same errnos.
Functions act on a :class:`KernelState`; they raise an ``OSError`` before changing anything they cannot finish
(the caller discards the state on error anyway).
"""

from __future__ import annotations

import errno

from gpumode.emulated import nvidia
from gpumode.emulated.errors import kernel_error
from gpumode.emulated.state import Device, Driver, KernelState, MatchRule

PCI_ANY_ID = 0xFFFFFFFF


# --- matching (pci_match_device) ----------------------------------------------------------------------------


def match_device(drv: Driver, dev: Device) -> bool:
    """``pci_match_device``: override gate, dynamic ids, id table (override_only entries), override
    fallback."""
    override = dev.driver_override
    if override is not None and override != drv.name:
        return False
    if any(rule.matches(dev) for rule in drv.dynids):
        return True
    for rule in drv.ids:
        if rule.matches(dev) and (not rule.override_only or override == drv.name):
            return True
    return override == drv.name


def _can_probe(state: KernelState, drv: Driver, dev: Device) -> bool:
    """``pci_device_can_probe``: a VF whose PF has ``sriov_drivers_autoprobe=0`` only binds to its
    override."""
    if dev.physfn is None:
        return True
    pf = state.devices.get(dev.physfn)
    return pf is None or pf.sriov_drivers_autoprobe or dev.driver_override == drv.name


# --- IOMMU groups and DMA ownership -------------------------------------------------------------------------


def group_members(state: KernelState, group: int) -> list[Device]:
    return [d for d in state.present_devices() if d.iommu_group == group]


def group_owned(state: KernelState, group: int) -> bool:
    """A group is owned by userspace while any member's VFIO device is open (``group->owner`` set)."""
    members = {d.address for d in group_members(state, group)}
    return any(h.kind == "vfio" and h.target in members for h in state.handles)


def group_viable(state: KernelState, group: int) -> bool:
    """Every member is unbound or bound to a ``driver_managed_dma`` driver (vfio-pci, pci-stub, pcieport)."""
    for dev in group_members(state, group):
        if dev.driver is None or nvidia.is_vendor_vf(state, dev):  # vendor VFs are vfio_pci_core devices
            continue
        drv = state.drivers.get(dev.driver)
        if drv is None or not drv.managed_dma:
            return False
    return True


# --- probe / bind / unbind ----------------------------------------------------------------------------------


def probe(state: KernelState, drv: Driver, dev: Device) -> None:
    """``really_probe``: bind ``dev`` to ``drv`` or raise the errno the probe returns."""
    if not _can_probe(state, drv, dev):
        raise kernel_error(
            errno.ENODEV, f"{dev.address}: VF autoprobe disabled on its PF, no override to {drv.name}"
        )
    if not drv.managed_dma and dev.iommu_group is not None and group_owned(state, dev.iommu_group):
        raise kernel_error(
            errno.EBUSY,
            f"{dev.address}: IOMMU group {dev.iommu_group} is owned by a VFIO user; {drv.name} needs DMA",
        )
    if drv.vfio and dev.iommu_group is None:
        # vfio_pci_core_register_device(): no IOMMU group, no VFIO device
        raise kernel_error(errno.EINVAL, f"{dev.address}: no IOMMU group (is the IOMMU enabled?)")
    dev.driver = drv.name
    dev.unbind_lock = False
    if drv.vfio:
        dev.vfio_index = state.free_vfio_index()


def detach(state: KernelState, dev: Device) -> None:
    """``device_driver_detach`` with every side effect of the driver's remove()."""
    if dev.driver is None:
        return
    drv = state.drivers.get(dev.driver)
    if dev.driver == "nvidia":
        nvidia.before_unbind(state, dev)
    if (
        drv is not None
        and drv.vfio
        and any(h.kind == "vfio" and h.target == dev.address for h in state.handles)
    ):
        # real: vfio_unregister_group_dev() waits until the user closes the device
        raise kernel_error(
            errno.EBUSY, f"{dev.address}: VFIO device still open by a user (real kernel blocks)"
        )
    dev.driver = None
    dev.vfio_index = None
    dev.unbind_lock = False


def bind(state: KernelState, driver_name: str, address: str) -> None:
    """``drivers/<X>/bind`` ← BDF."""
    drv = state.drivers[driver_name]
    dev = state.present(address)
    if dev is None or not match_device(drv, dev):
        what = "no such device" if dev is None else f"{driver_name} does not match it"
        raise kernel_error(errno.ENODEV, f"{address}: {what}")
    if dev.driver is not None:
        raise kernel_error(errno.EBUSY, f"{address}: already bound to {dev.driver}")
    probe(state, drv, dev)


def unbind(state: KernelState, driver_name: str, address: str) -> None:
    """``drivers/<X>/unbind`` ← BDF."""
    dev = state.present(address)
    if dev is None or dev.driver != driver_name:
        raise kernel_error(errno.ENODEV, f"{address}: not bound to {driver_name}")
    detach(state, dev)


def attach(state: KernelState, dev: Device) -> bool:
    """``device_attach``: try each registered driver in registration order; True when the device is bound."""
    if dev.driver is not None:
        return True
    for drv in state.drivers.values():
        if not match_device(drv, dev):
            continue
        try:
            probe(state, drv, dev)
        except OSError:
            continue  # a failing probe lets the next matching driver try, as the driver core does
        return True
    return False


def driver_attach(state: KernelState, drv: Driver) -> None:
    """``driver_attach``: offer every unbound present device to ``drv``."""
    for dev in state.present_devices():
        if dev.driver is None and match_device(drv, dev):
            try:
                probe(state, drv, dev)
            except OSError:
                continue


def probe_new_device(state: KernelState, dev: Device) -> None:
    """A device was added (VF created, rescan): probe it if the bus autoprobes."""
    if state.bus_autoprobe:
        attach(state, dev)


def register_driver(state: KernelState, drv: Driver) -> None:
    if drv.name in state.drivers:
        raise kernel_error(errno.EBUSY, f"driver {drv.name} is already registered")
    state.drivers[drv.name] = drv
    if state.bus_autoprobe:
        driver_attach(state, drv)


def unregister_driver(state: KernelState, name: str) -> None:
    """Unbind every device from the driver (full side effects), then drop it (and its dynamic ids)."""
    for dev in state.present_devices():
        if dev.driver == name:
            detach(state, dev)
    del state.drivers[name]


# --- new_id / remove_id -------------------------------------------------------------------------------------


def _scan_hex(value: str, limit: int) -> list[int]:
    """``sscanf("%x %x ...")``: leading hex fields, stopping at the first that does not parse."""
    out = []
    for token in value.split()[:limit]:
        try:
            out.append(int(token, 16))
        except ValueError:
            break
    return out


def _any(value: int) -> int | None:
    return None if value == PCI_ANY_ID else value


def new_id(state: KernelState, driver_name: str, value: str) -> None:
    """``new_id`` ← ``VVVV DDDD [SVVV SDDD CCCC MMMM PPPP]``: add a dynamic id, then probe unbound devices."""
    drv = state.drivers[driver_name]
    fields = _scan_hex(value, 7)
    if len(fields) < 2:
        raise kernel_error(errno.EINVAL, f"new_id needs at least vendor and device, got {value.strip()!r}")
    vendor, device = fields[0], fields[1]
    subvendor = fields[2] if len(fields) > 2 else PCI_ANY_ID
    subdevice = fields[3] if len(fields) > 3 else PCI_ANY_ID
    class_code = fields[4] if len(fields) > 4 else 0
    class_mask = fields[5] if len(fields) > 5 else 0
    if len(fields) == 7 and fields[6] != 0:
        raise kernel_error(errno.EINVAL, f"driver_data {fields[6]:#x} is not in {driver_name}'s id table")
    if len(fields) != 7:
        probe_dev = Device(
            address="new_id",
            vendor=vendor,
            device=device,
            class_code=class_code,
            subsystem_vendor=subvendor,
            subsystem_device=subdevice,
        )
        if match_device(drv, probe_dev):
            raise kernel_error(errno.EEXIST, f"{driver_name} already matches {vendor:04x}:{device:04x}")
    drv.dynids.append(
        MatchRule(_any(vendor), _any(device), _any(subvendor), _any(subdevice), class_code, class_mask)
    )
    driver_attach(state, drv)


def remove_id(state: KernelState, driver_name: str, value: str) -> None:
    """``remove_id`` ← ``VVVV DDDD [...]``: drop a matching dynamic id (ENODEV when there is none)."""
    drv = state.drivers[driver_name]
    fields = _scan_hex(value, 6)
    if len(fields) < 2:
        raise kernel_error(errno.EINVAL, f"remove_id needs at least vendor and device, got {value.strip()!r}")
    subvendor = fields[2] if len(fields) > 2 else PCI_ANY_ID
    subdevice = fields[3] if len(fields) > 3 else PCI_ANY_ID
    class_code = fields[4] if len(fields) > 4 else 0
    class_mask = fields[5] if len(fields) > 5 else 0
    for rule in drv.dynids:
        if (
            rule.vendor == _any(fields[0])
            and rule.device == _any(fields[1])
            and (subvendor == PCI_ANY_ID or rule.subvendor == subvendor)
            and (subdevice == PCI_ANY_ID or rule.subdevice == subdevice)
            and rule.class_code == class_code
            and rule.class_mask == class_mask
        ):
            drv.dynids.remove(rule)
            return
    raise kernel_error(errno.ENODEV, f"{driver_name} has no dynamic id {value.strip()!r}")
