"""PCI device lifecycle: SR-IOV enable/disable, hot-remove, rescan, and the bus topology numbers.

Mirrors ``drivers/pci/{iov,remove,probe}.c``: VFs appear as siblings of their PF at PF + offset + n·stride,
each in a new IOMMU group, and are probed as the PF's ``sriov_drivers_autoprobe`` says; ``remove`` unbinds and
deletes a device and everything below it; ``rescan`` brings hot-removed hardware back, unbound, and probes it.
"""

from __future__ import annotations

import errno
from functools import lru_cache

from gpumode.domain import PciAddress
from gpumode.emulated import drivers
from gpumode.emulated.errors import kernel_error, kstrtoul
from gpumode.emulated.state import Device, KernelState


@lru_cache(maxsize=8192)
def parse_address(address: str) -> PciAddress:
    """``PciAddress.parse``, remembered: every render walks the topology again, and addresses never change."""
    return PciAddress.parse(address)


def vf_address(pf: Device, index: int) -> str:
    base = parse_address(pf.address)
    rid = base.routing_id + pf.sriov_offset + index * pf.sriov_stride
    return str(PciAddress.from_routing_id(base.domain, rid))


def write_sriov_numvfs(state: KernelState, pf: Device, value: str) -> None:
    """``sriov_numvfs_store``: EINVAL, ERANGE, no-op on equal, ENOENT without a capable driver, EBUSY n→m."""
    try:
        wanted = kstrtoul(value)
    except ValueError:
        raise kernel_error(errno.EINVAL, f"sriov_numvfs expects a number, got {value!r}") from None
    if wanted > 0xFFFF:
        raise kernel_error(errno.EINVAL, f"sriov_numvfs {wanted} does not fit u16")
    if wanted > pf.sriov_total_vfs:
        raise kernel_error(errno.ERANGE, f"{wanted} VFs requested, sriov_totalvfs is {pf.sriov_total_vfs}")
    if wanted == pf.sriov_numvfs:
        return
    if pf.driver is None:
        raise kernel_error(errno.ENOENT, f"{pf.address}: no driver bound to device; cannot configure SR-IOV")
    drv = state.drivers.get(pf.driver)
    if drv is None or not drv.sriov_configure:
        raise kernel_error(
            errno.ENOENT, f"{pf.address}: driver {pf.driver} does not support SR-IOV configuration"
        )
    if wanted == 0:
        disable_vfs(state, pf)
        return
    if pf.sriov_numvfs != 0:
        raise kernel_error(errno.EBUSY, f"{pf.address}: {pf.sriov_numvfs} VFs already enabled; disable first")
    enable_vfs(state, pf, wanted)


def enable_vfs(state: KernelState, pf: Device, count: int) -> list[Device]:
    """Create ``count`` VFs (new IOMMU groups when the host has an IOMMU) and probe them."""
    created = []
    for index in range(count):
        address = vf_address(pf, index)
        if address in state.devices:
            raise kernel_error(errno.EBUSY, f"VF {index} of {pf.address} would be {address}, which exists")
        vf = Device(
            address=address,
            vendor=pf.vendor,
            device=pf.sriov_vf_device or pf.device,
            class_code=pf.class_code,
            revision=pf.revision,
            # NVIDIA VFs report subsystem 10de:0000 (the board's id stays on the PF)
            subsystem_vendor=pf.subsystem_vendor,
            subsystem_device=0,
            parent=pf.parent,
            numa_node=pf.numa_node,
            pcie=pf.pcie,
            physfn=pf.address,
            vf_index=index,
            gpu_uuid=_vf_uuid(pf, index),
        )
        state.devices[address] = vf
        if state.iommu:
            vf.iommu_group = state.free_iommu_group()
        created.append(vf)
    pf.sriov_numvfs = count
    for vf in created:
        drivers.probe_new_device(state, vf)
    return created


def _vf_uuid(pf: Device, index: int) -> str:
    if not pf.gpu_uuid:
        return ""
    return pf.gpu_uuid[:-4] + f"{(int(pf.gpu_uuid[-4:], 16) + index + 1) & 0xFFFF:04x}"


def disable_vfs(state: KernelState, pf: Device) -> None:
    """Unbind (full side effects: their mdevs and vGPUs go) and delete every VF of ``pf``."""
    for vf in reversed(state.vfs_of(pf.address)):
        drivers.detach(state, vf)
        del state.devices[vf.address]
    pf.sriov_numvfs = 0


def _descendants(state: KernelState, dev: Device) -> list[Device]:
    """Everything below ``dev``: its VFs, and for a bridge every device behind it (depth-first)."""
    out: list[Device] = []
    for child in sorted(state.devices.values(), key=lambda d: d.address):
        if child.present and (child.parent == dev.address or child.physfn == dev.address):
            out.extend(_descendants(state, child))
            out.append(child)
    return out


def write_remove(state: KernelState, dev: Device, value: str) -> None:
    """``remove`` ← non-zero: hot-remove the device and its subtree (drivers unbound, VFs destroyed)."""
    try:
        if kstrtoul(value) == 0:
            return
    except ValueError:
        raise kernel_error(errno.EINVAL, f"remove expects a number, got {value!r}") from None
    for victim in [*_descendants(state, dev), dev]:
        if victim.address not in state.devices:
            continue
        if victim.physfn is None and victim.sriov_numvfs:
            disable_vfs(state, victim)
        drivers.detach(state, victim)
        if victim.is_vf:
            del state.devices[victim.address]
            continue
        victim.present = False
        victim.driver_override = None
        victim.enable_cnt = 0
        victim.sriov_drivers_autoprobe = True


def _top_removed(state: KernelState, dev: Device) -> Device:
    while dev.parent is not None and not state.devices[dev.parent].present:
        dev = state.devices[dev.parent]
    return dev


def rescan(state: KernelState, parent_bus_of: Device | None = None) -> list[Device]:
    """Bring back hot-removed hardware (all of it, or what hangs off the bus ``parent_bus_of`` sits on)."""
    back = []
    for dev in sorted(state.devices.values(), key=lambda d: d.address):
        if dev.present or dev.is_vf:
            continue
        if parent_bus_of is not None and _top_removed(state, dev).parent != parent_bus_of.parent:
            continue
        back.append(dev)
    for dev in back:
        dev.present = True
    for dev in back:
        drivers.probe_new_device(state, dev)
    return back


def child_index(state: KernelState) -> dict[str, list[Device]]:
    """Non-VF devices (present or not) by parent address, in state order: the bus topology."""
    children: dict[str, list[Device]] = {}
    for dev in state.devices.values():
        if dev.parent is not None and not dev.is_vf:
            children.setdefault(dev.parent, []).append(dev)
    return children


def bridge_buses(
    state: KernelState, bridge: Device, children: dict[str, list[Device]] | None = None
) -> tuple[int, int, int]:
    """(primary, secondary, subordinate) bus numbers of a bridge, from the devices below it (VF buses
    included). ``children`` is :func:`child_index` of ``state``, when the caller asks for many bridges."""
    index = child_index(state) if children is None else children
    primary = parse_address(bridge.address).bus
    buses: list[int] = []
    direct: list[int] = []

    def walk(node: Device) -> None:
        for child in index.get(node.address, ()):
            bus = parse_address(child.address).bus
            buses.append(bus)
            if node is bridge:
                direct.append(bus)
            if child.sriov_total_vfs:
                last = vf_address(child, child.sriov_total_vfs - 1)
                buses.append(parse_address(last).bus)
            walk(child)

    walk(bridge)
    if not direct:
        return primary, 0, 0
    return primary, min(direct), max(buses)
