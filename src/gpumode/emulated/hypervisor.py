"""The emulated host's hypervisor: VMs defined in libvirt's domain XML, running ones holding their devices.

Definitions live where libvirt keeps them (``etc/libvirt/qemu/<name>.xml``, ``<hostdev>`` elements for PCI
functions and mdevs); a running VM has ``run/libvirt/qemu/<name>.pid`` as libvirt's QEMU driver does. Starting
a VM opens each of its devices through the emulated kernel the way QEMU does (a VFIO device per PCI function,
the mdev), so the kernel's rules apply: a device on a host driver, a non-viable IOMMU group, a VF without a
vGPU type or an mdev held by another VM make the start fail with a QEMU-like error, and while the VM runs
those devices cannot be unbound, destroyed or handed to a host driver. Shutting it down closes them.
"""

from __future__ import annotations

import uuid as uuidlib
import xml.etree.ElementTree as ET
from pathlib import Path

from gpumode.domain import PciAddress, PciAddressError
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.host.root import Host
from gpumode.host.vms import HypervisorError, Vm, VmDevice

DEFINITIONS = "etc/libvirt/qemu"
RUNTIME = "run/libvirt/qemu"


def holder(name: str) -> str:
    """The name a VM's open devices are held under in the emulated kernel."""
    return f"qemu:{name}"


def domain_xml(
    name: str, vm_uuid: str, devices: list[VmDevice], *, memory_gib: int = 16, vcpus: int = 8
) -> str:
    """A libvirt domain definition, one ``<hostdev>`` per device (``managed='no'``: gpumode binds them)."""
    root = ET.Element("domain", type="kvm")
    ET.SubElement(root, "name").text = name
    ET.SubElement(root, "uuid").text = vm_uuid
    ET.SubElement(root, "memory", unit="KiB").text = str(memory_gib * 1024 * 1024)
    ET.SubElement(root, "vcpu", placement="static").text = str(vcpus)
    os_el = ET.SubElement(root, "os")
    ET.SubElement(os_el, "type", arch="x86_64", machine="pc-q35-8.2").text = "hvm"
    devs = ET.SubElement(root, "devices")
    ET.SubElement(devs, "emulator").text = "/usr/bin/qemu-system-x86_64"
    for dev in devices:
        _add_hostdev(devs, dev)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode") + "\n"


def _add_hostdev(devs: ET.Element, dev: VmDevice) -> None:
    if dev.kind == "pci":
        addr = PciAddress.parse(dev.id)
        el = ET.SubElement(devs, "hostdev", mode="subsystem", type="pci", managed="no")
        ET.SubElement(
            ET.SubElement(el, "source"),
            "address",
            domain=f"0x{addr.domain:04x}",
            bus=f"0x{addr.bus:02x}",
            slot=f"0x{addr.device:02x}",
            function=f"0x{addr.function:x}",
        )
    else:
        el = ET.SubElement(devs, "hostdev", mode="subsystem", type="mdev", model="vfio-pci", display="off")
        ET.SubElement(ET.SubElement(el, "source"), "address", uuid=dev.id)


def _hostdevs(root: ET.Element) -> list[VmDevice]:
    out: list[VmDevice] = []
    for el in root.iter("hostdev"):
        addr = el.find("source/address")
        if addr is None:
            continue
        if el.get("type") == "pci":
            out.append(
                VmDevice(
                    "pci",
                    str(
                        PciAddress(
                            int(addr.get("domain", "0"), 16),
                            int(addr.get("bus", "0"), 16),
                            int(addr.get("slot", "0"), 16),
                            int(addr.get("function", "0"), 16),
                        )
                    ),
                )
            )
        elif el.get("type") == "mdev" and addr.get("uuid"):
            out.append(VmDevice("mdev", str(addr.get("uuid")).lower()))
    return out


def _check_device(device: VmDevice) -> VmDevice:
    if device.kind == "pci":
        try:
            return VmDevice("pci", str(PciAddress.parse(device.id)))
        except PciAddressError as exc:
            raise HypervisorError(f"bad PCI device {device.id!r}: {exc}") from None
    if device.kind == "mdev":
        try:
            return VmDevice("mdev", str(uuidlib.UUID(device.id)))
        except ValueError:
            raise HypervisorError(f"bad mdev uuid {device.id!r}") from None
    raise HypervisorError(f"unknown device kind {device.kind!r} (expected pci or mdev)")


class EmulatedHypervisor:
    """The :class:`~gpumode.host.vms.Hypervisor` of an emulated host."""

    def __init__(self, host: Host) -> None:
        if not host.emulated:
            raise HypervisorError(f"{host} is not an emulated host")
        self.host = host
        self.kernel = EmulatedKernel(host.root)

    # --- definitions ---------------------------------------------------------------------------------------

    def _xml_path(self, name: str) -> Path:
        return self.host.path(DEFINITIONS, f"{name}.xml")

    def _pid_path(self, name: str) -> Path:
        return self.host.path(RUNTIME, f"{name}.pid")

    def _load(self, name: str) -> ET.Element:
        path = self._xml_path(name)
        if not name or "/" in name or not path.is_file():
            raise HypervisorError(f"failed to get domain '{name}': Domain not found")
        return ET.parse(path).getroot()

    def _save(self, name: str, root: ET.Element) -> None:
        ET.indent(root)
        path = self._xml_path(name)
        tmp = path.with_suffix(".xml.tmp")
        tmp.write_text(ET.tostring(root, encoding="unicode") + "\n")
        tmp.replace(path)

    def define(self, name: str, devices: list[VmDevice], vm_uuid: str | None = None) -> None:
        """``virsh define``: a new VM (stopped). An existing name is an error."""
        if not name or "/" in name or name.startswith("."):
            raise HypervisorError(f"bad VM name {name!r}")
        if self._xml_path(name).exists():
            raise HypervisorError(f"operation failed: domain '{name}' already exists")
        checked = [_check_device(d) for d in devices]
        path = self._xml_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(domain_xml(name, vm_uuid or str(uuidlib.uuid4()), checked))

    def is_running(self, name: str) -> bool:
        return self._pid_path(name).exists()

    # --- the Hypervisor protocol ---------------------------------------------------------------------------

    def list_vms(self) -> list[Vm]:
        base = self.host.path(DEFINITIONS)
        if not base.is_dir():
            return []
        vms = []
        for path in sorted(base.glob("*.xml")):
            root = ET.parse(path).getroot()
            vms.append(
                Vm(
                    name=root.findtext("name", path.stem),
                    uuid=root.findtext("uuid", ""),
                    running=self.is_running(path.stem),
                    devices=_hostdevs(root),
                )
            )
        return vms

    def start(self, name: str) -> None:
        root = self._load(name)
        if self.is_running(name):
            return
        who = holder(name)
        for dev in _hostdevs(root):
            try:
                if dev.kind == "pci":
                    self.kernel.open_handle(who, "vfio", dev.id)
                else:
                    self.kernel.open_handle(who, "mdev", dev.id)
            except OSError as exc:
                self.kernel.close_all(who)  # QEMU exits: whatever it had opened is closed
                raise HypervisorError(self._qemu_error(name, dev, exc)) from exc
        pid = self._pid_path(name)
        pid.parent.mkdir(parents=True, exist_ok=True)
        pid.write_text(f"{4000 + sum(map(ord, name)) % 60000}\n")

    def _qemu_error(self, name: str, dev: VmDevice, exc: OSError) -> str:
        detail = exc.strerror or str(exc)
        if dev.kind == "mdev":
            where = f"vfio {dev.id}"
        else:
            where = f"vfio {dev.id}"
            if not self.host.path("sys/bus/pci/devices", dev.id).exists():
                detail = f"failed to open /sys/bus/pci/devices/{dev.id}/: No such file or directory"
        return (
            f"failed to start VM '{name}': internal error: qemu unexpectedly closed the monitor: "
            f"{where}: {detail}"
        )

    def shutdown(self, name: str, *, timeout: float = 60.0) -> None:
        self._load(name)
        if not self.is_running(name):
            return
        self.kernel.close_all(holder(name))
        self._pid_path(name).unlink(missing_ok=True)

    def detach_device(self, name: str, device: VmDevice) -> None:
        root = self._load(name)
        device = _check_device(device)
        if self.is_running(name):
            raise HypervisorError(
                f"cannot detach {device} from VM '{name}': the VM is running (stop it first)"
            )
        devs = root.find("devices")
        if devs is None:
            return
        for el in list(devs.iter("hostdev")):
            if _hostdevs(_wrap(el)) == [device]:
                devs.remove(el)
        self._save(name, root)

    def attach_device(self, name: str, device: VmDevice) -> None:
        root = self._load(name)
        device = _check_device(device)
        if self.is_running(name):
            raise HypervisorError(f"cannot attach {device} to VM '{name}': the VM is running (stop it first)")
        if device in _hostdevs(root):
            return
        devs = root.find("devices")
        if devs is None:
            devs = ET.SubElement(root, "devices")
        _add_hostdev(devs, device)
        self._save(name, root)


def _wrap(el: ET.Element) -> ET.Element:
    box = ET.Element("devices")
    box.append(el)
    return box
