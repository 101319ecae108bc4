"""The 256-byte PCI configuration header of an emulated function (``<dev>/config``).

Enough of it for ``lspci -A linux-sysfs`` to agree with the sysfs attributes: ids, command/status, class,
header type (0, or 1 for PCI bridges with the bus numbers of the emulated tree), subsystem ids, and a PCI
Express capability at 0x40 on PCIe functions (with the link speed/width sysfs shows).
"""

from __future__ import annotations

import struct

CONFIG_SIZE = 256
PCIE_CAP_OFFSET = 0x40
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
) -> bytes:
    """Config space bytes; ``bridge_buses`` = (primary, secondary, subordinate) makes a type-1 header."""
    cfg = bytearray(CONFIG_SIZE)
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
    if pcie:
        cfg[0x34] = PCIE_CAP_OFFSET
        # capability id 0x10 (PCI Express), next 0, flags: version 2 | port type
        struct.pack_into("<BBH", cfg, PCIE_CAP_OFFSET, 0x10, 0x00, 0x0002 | (port_type << 4))
        link = link_speed | (link_width << 4)
        struct.pack_into("<I", cfg, PCIE_CAP_OFFSET + 0x0C, link)  # Link Capabilities
        struct.pack_into("<H", cfg, PCIE_CAP_OFFSET + 0x12, link)  # Link Status
    return bytes(cfg)
