"""The PCI configuration space of an emulated function (``<dev>/config``).

Enough of it for ``lspci -A linux-sysfs -vvv`` to agree with the sysfs attributes: ids, command/status,
class, header type (0, or 1 for PCI bridges with the bus numbers of the emulated tree), subsystem ids, BAR 0
where ``resource`` puts it, and a capability list: PCI Express at 0x40 on PCIe functions (with the link
speed/width sysfs shows); on GPUs also power management and MSI-X, as every NVIDIA GPU has them; and on an
SR-IOV PF the SR-IOV extended capability at 0x100 (TotalVFs, NumVFs, offset, stride, VF device id), which
needs the 4096-byte extended configuration space a PCIe function has (PCIe base spec, "Extended
Configuration Space"; capability ids from the Linux ``pci_regs.h``).
"""

from __future__ import annotations

import struct

CONFIG_SIZE = 256
EXTENDED_CONFIG_SIZE = 4096
PCIE_CAP_OFFSET = 0x40
PM_CAP_OFFSET = 0x80
MSIX_CAP_OFFSET = 0x90
SRIOV_CAP_OFFSET = 0x100
CAP_ID_PM, CAP_ID_MSIX, CAP_ID_PCIE = 0x01, 0x11, 0x10
EXT_CAP_ID_SRIOV = 0x0010
LINK_SPEED_GTS = {
    1: "2.5 GT/s PCIe",
    2: "5.0 GT/s PCIe",
    3: "8.0 GT/s PCIe",
    4: "16.0 GT/s PCIe",
    5: "32.0 GT/s PCIe",
}

# PCIe device/port types (PCI_EXP_FLAGS_TYPE)
PCIE_ENDPOINT = 0x0
PCIE_ROOT_PORT = 0x4
PCIE_DOWNSTREAM_PORT = 0x6


def build_config(
    *,
    vendor: int,
    device: int,
    class_code: int,
    revision: int,
    subsystem_vendor: int,
    subsystem_device: int,
    multifunction: bool,
    pcie: bool,
    port_type: int = PCIE_ENDPOINT,
    bridge_buses: tuple[int, int, int] | None = None,
    irq: int = 0,
    link_speed: int = 4,
    link_width: int = 16,
    gpu: bool = False,
    bar0: tuple[int, int] | None = None,
    sriov: tuple[int, int, int, int, int] | None = None,
) -> bytes:
    """Config space bytes; ``bridge_buses`` = (primary, secondary, subordinate) makes a type-1 header.

    ``gpu`` adds power management and MSI-X; ``bar0`` = (start, size) a 32-bit memory BAR 0 (start below
    4 GiB) or a 64-bit one; ``sriov`` = (total, num, offset, stride, VF device id) the SR-IOV capability."""
    cfg = bytearray(EXTENDED_CONFIG_SIZE if pcie else CONFIG_SIZE)
    status = 0x0010 if pcie else 0x0000  # capabilities list present
    command = 0x0007 if bridge_buses else 0x0006  # memory space + bus master (+ I/O for bridges)
    struct.pack_into("<HHHH", cfg, 0x00, vendor, device, command, status)
    cfg[0x08] = revision & 0xFF
    cfg[0x09] = class_code & 0xFF
    cfg[0x0A] = (class_code >> 8) & 0xFF
    cfg[0x0B] = (class_code >> 16) & 0xFF
    header = 0x01 if bridge_buses else 0x00
    cfg[0x0E] = header | (0x80 if multifunction else 0)
    if bridge_buses:
        cfg[0x18], cfg[0x19], cfg[0x1A] = bridge_buses
    else:
        struct.pack_into("<HH", cfg, 0x2C, subsystem_vendor, subsystem_device)
        cfg[0x3C] = irq & 0xFF
        cfg[0x3D] = 1  # INTA
    if bar0 is not None and not bridge_buses:
        start, _size = bar0
        if start >> 32:
            # memory, 64-bit (type 2 in bits 2:1): the upper half in BAR 1
            struct.pack_into("<II", cfg, 0x10, (start & 0xFFFFFFF0) | 0x4, start >> 32)
        else:
            struct.pack_into("<I", cfg, 0x10, start & 0xFFFFFFF0)
    if pcie:
        cfg[0x34] = PCIE_CAP_OFFSET
        # PCI Express, flags: version 2 | port type; next: PM on GPUs
        after_pcie = PM_CAP_OFFSET if gpu else 0x00
        struct.pack_into("<BBH", cfg, PCIE_CAP_OFFSET, CAP_ID_PCIE, after_pcie, 0x0002 | (port_type << 4))
        link = link_speed | (link_width << 4)
        struct.pack_into("<I", cfg, PCIE_CAP_OFFSET + 0x0C, link)  # Link Capabilities
        struct.pack_into("<H", cfg, PCIE_CAP_OFFSET + 0x12, link)  # Link Status
    elif gpu:
        cfg[0x34] = PM_CAP_OFFSET
        struct.pack_into("<H", cfg, 0x06, 0x0010)
    if gpu:
        # power management v3 (PMC 0x0003), D0; then MSI-X: table size 9 (10 vectors), table and PBA in BAR 0
        struct.pack_into("<BBHH", cfg, PM_CAP_OFFSET, CAP_ID_PM, MSIX_CAP_OFFSET, 0x0003, 0x0008)
        struct.pack_into("<BBHII", cfg, MSIX_CAP_OFFSET, CAP_ID_MSIX, 0x00, 9, 0x00B90000, 0x00BA0000)
    if sriov is not None and pcie:
        total, num, offset, stride, vf_device = sriov
        # header: id, version 1, next 0; capabilities, control (VF enable + memory space when VFs exist),
        # status, InitialVFs, TotalVFs, NumVFs, function dependency link, offset, stride, reserved, VF device
        struct.pack_into("<I", cfg, SRIOV_CAP_OFFSET, EXT_CAP_ID_SRIOV | (1 << 16))
        control = 0x0009 if num else 0x0000
        struct.pack_into(
            "<IHHHHHHHHHH",
            cfg,
            SRIOV_CAP_OFFSET + 0x04,
            0,
            control,
            0,
            total,
            total,
            num,
            0,
            offset,
            stride,
            0,
            vf_device,
        )
    return bytes(cfg)
