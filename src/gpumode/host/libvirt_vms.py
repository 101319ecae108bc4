"""The :class:`~gpumode.host.vms.Hypervisor` of a real host: libvirt, through libvirt-python.

Devices are read from, and written to, the domain XML — the one place libvirt keeps them. Detaching rewrites
the *persistent* definition (``defineXML``) rather than hot-unplugging: the mode engine only touches stopped
VMs, and a persistent edit is what survives their next start. The removed ``<hostdev>`` is kept as is in the
domain's ``<metadata>`` so that a rollback puts back exactly what was there (``managed``, the guest-side
``<address>``, ``<rom>``…), even after a crash of gpumode between the two.
"""

from __future__ import annotations

import contextlib
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

from gpumode.domain import PciAddress, PciAddressError
from gpumode.host.vms import HypervisorError, HypervisorUnavailable, Vm, VmDevice

# Our private corner of <metadata>: detached <hostdev> elements wait here for a rollback.
METADATA_NS = "https://gpumode.dev/xmlns/libvirt/1"
_DETACHED = f"{{{METADATA_NS}}}detached"

# Keep the usual prefixes when a definition passes through ElementTree (else they come back as ns0:, ns1:).
for _prefix, _uri in {
    "gpumode": METADATA_NS,
    "qemu": "http://libvirt.org/schemas/domain/qemu/1.0",
    "lxc": "http://libvirt.org/schemas/domain/lxc/1.0",
    "bhyve": "http://libvirt.org/schemas/domain/bhyve/1.0",
}.items():
    ET.register_namespace(_prefix, _uri)


def _libvirt() -> Any:
    """Import libvirt-python lazily: the rest of gpumode (and emulated hosts) must work without it."""
    try:
        import libvirt
    except ImportError as exc:
        raise HypervisorUnavailable(
            "no hypervisor library: libvirt-python is not installed; install the extra gpumode[libvirt] "
            "(needs libvirt-dev and pkg-config)"
        ) from exc
    return libvirt


def hostdev_device(element: ET.Element) -> VmDevice | None:
    """The device a ``<hostdev>`` element names, or None for kinds gpumode does not manage (USB, SCSI…)."""
    if element.get("mode", "subsystem") != "subsystem":
        return None
    address = element.find("source/address")
    if address is None:
        return None
    kind = element.get("type")
    if kind == "pci":
        try:
            pci = PciAddress(
                int(address.get("domain", "0"), 0),
                int(address.get("bus", ""), 0),
                int(address.get("slot", ""), 0),
                int(address.get("function", ""), 0),
            )
        except ValueError:
            return None
        return VmDevice("pci", str(pci))
    if kind == "mdev" and address.get("uuid"):
        return VmDevice("mdev", address.get("uuid", "").lower())
    return None


def hostdev_element(device: VmDevice) -> ET.Element:
    """A fresh ``<hostdev>`` for ``device``.

    PCI devices are ``managed='no'``: gpumode binds them to vfio-pci itself and must stay the owner of that
    binding (libvirt hands a managed device back to its host driver whenever the VM stops).
    """
    if device.kind == "pci":
        try:
            pci = PciAddress.parse(device.id)
        except PciAddressError as exc:
            raise HypervisorError(f"cannot attach {device}: {exc}") from exc
        hostdev = ET.Element("hostdev", {"mode": "subsystem", "type": "pci", "managed": "no"})
        source = ET.SubElement(hostdev, "source")
        ET.SubElement(
            source,
            "address",
            {
                "domain": f"0x{pci.domain:04x}",
                "bus": f"0x{pci.bus:02x}",
                "slot": f"0x{pci.device:02x}",
                "function": f"0x{pci.function:x}",
            },
        )
        return hostdev
    hostdev = ET.Element("hostdev", {"mode": "subsystem", "type": "mdev", "model": "vfio-pci"})
    source = ET.SubElement(hostdev, "source")
    ET.SubElement(source, "address", {"uuid": device.id.lower()})
    return hostdev


def devices_of(domain_xml: str) -> list[VmDevice]:
    """The host devices (PCI functions and mdevs) a domain definition holds, in document order."""
    root = ET.fromstring(domain_xml)
    found = (hostdev_device(el) for el in root.findall("devices/hostdev"))
    return [dev for dev in found if dev is not None]


def _same_device(element: ET.Element, device: VmDevice) -> bool:
    found = hostdev_device(element)
    return found is not None and found.kind == device.kind and found.id == _canonical(device).id


def _canonical(device: VmDevice) -> VmDevice:
    if device.kind == "pci":
        try:
            return VmDevice("pci", str(PciAddress.parse(device.id)))
        except PciAddressError as exc:
            raise HypervisorError(f"bad device {device}: {exc}") from exc
    return VmDevice("mdev", device.id.lower())


class LibvirtHypervisor:
    """VMs of one libvirt connection (``qemu:///system`` on a KVM host, ``test:///default`` in tests)."""

    def __init__(
        self,
        uri: str,
        *,
        poll_interval: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.uri = uri
        self.poll_interval = poll_interval
        self._clock = clock
        self._sleep = sleep
        self._conn: Any = None

    def __repr__(self) -> str:
        return f"LibvirtHypervisor({self.uri!r})"

    # --- connection -----------------------------------------------------------------------------------------

    @property
    def conn(self) -> Any:
        """The libvirt connection, opened on first use."""
        if self._conn is None:
            libvirt = _libvirt()
            # libvirt prints every error to stderr by default; HypervisorError carries the message instead.
            libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
            try:
                self._conn = libvirt.open(self.uri)
            except libvirt.libvirtError as exc:
                raise HypervisorUnavailable(
                    f"no hypervisor running: cannot connect to libvirt at {self.uri}: {exc}"
                ) from exc
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _domain(self, name: str) -> Any:
        libvirt = _libvirt()
        try:
            return self.conn.lookupByName(name)
        except libvirt.libvirtError as exc:
            raise HypervisorError(f"no VM named {name!r} at {self.uri}") from exc

    def _call(self, what: str, name: str, fn: Callable[[], Any]) -> Any:
        libvirt = _libvirt()
        try:
            return fn()
        except libvirt.libvirtError as exc:
            raise HypervisorError(f"{what} VM {name!r} failed: {exc}") from exc

    # --- Hypervisor protocol --------------------------------------------------------------------------------

    def list_vms(self) -> list[Vm]:
        vms = []
        for dom in self._call("listing", "*", lambda: self.conn.listAllDomains(0)):
            vms.append(
                Vm(
                    name=dom.name(),
                    uuid=dom.UUIDString(),
                    running=bool(dom.isActive()),
                    devices=devices_of(dom.XMLDesc(0)),
                )
            )
        return sorted(vms, key=lambda vm: vm.name)

    def shutdown(self, name: str, *, timeout: float = 60.0) -> None:
        dom = self._domain(name)
        if not dom.isActive():
            return
        libvirt = _libvirt()
        # The guest may go down on its own between isActive() and shutdown(); the poll below decides.
        with contextlib.suppress(libvirt.libvirtError):
            dom.shutdown()
        deadline = self._clock() + timeout
        while self._clock() < deadline:
            if not dom.isActive():
                return
            self._sleep(self.poll_interval)
        if dom.isActive():
            # The guest ignored ACPI (or is still busy): pull the plug, as ``virsh destroy`` would.
            try:
                dom.destroy()
            except libvirt.libvirtError as exc:
                if dom.isActive():
                    raise HypervisorError(
                        f"VM {name!r} did not shut down within {timeout:g}s and destroy failed: {exc}"
                    ) from exc

    def start(self, name: str) -> None:
        dom = self._domain(name)
        if dom.isActive():
            return
        self._call("starting", name, dom.create)

    def detach_device(self, name: str, device: VmDevice) -> None:
        device = _canonical(device)
        dom = self._domain(name)
        if dom.isActive():
            raise HypervisorError(f"cannot detach {device} from VM {name!r}: it is running (stop it first)")
        root = self._persistent_xml(dom, name)
        devices = root.find("devices")
        if devices is None:
            return
        matches = [el for el in devices.findall("hostdev") if _same_device(el, device)]
        if not matches:
            return
        stash = self._stash(root)
        for stale in [el for el in stash.findall("hostdev") if _same_device(el, device)]:
            stash.remove(stale)
        for element in matches:
            devices.remove(element)
            stash.append(element)
        self._define(root, name, f"detaching {device} from")

    def attach_device(self, name: str, device: VmDevice) -> None:
        device = _canonical(device)
        dom = self._domain(name)
        if dom.isActive():
            raise HypervisorError(f"cannot attach {device} to VM {name!r}: it is running (stop it first)")
        root = self._persistent_xml(dom, name)
        devices = root.find("devices")
        if devices is None:
            devices = ET.SubElement(root, "devices")
        if any(_same_device(el, device) for el in devices.findall("hostdev")):
            return
        stash = self._stash(root)
        stashed = [el for el in stash.findall("hostdev") if _same_device(el, device)]
        element = stashed[0] if stashed else hostdev_element(device)
        for el in stashed:
            stash.remove(el)
        devices.append(element)
        if not len(stash):
            self._drop_stash(root, stash)
        self._define(root, name, f"attaching {device} to")

    # --- helpers --------------------------------------------------------------------------------------------

    def _persistent_xml(self, dom: Any, name: str) -> ET.Element:
        libvirt = _libvirt()
        if not dom.isPersistent():
            raise HypervisorError(f"VM {name!r} is transient: it has no definition to change")
        xml = self._call("reading", name, lambda: dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        return ET.fromstring(xml)

    def _define(self, root: ET.Element, name: str, what: str) -> None:
        xml = ET.tostring(root, encoding="unicode")
        self._call(what, name, lambda: self.conn.defineXML(xml))

    @staticmethod
    def _stash(root: ET.Element) -> ET.Element:
        metadata = root.find("metadata")
        if metadata is None:
            metadata = ET.Element("metadata")
            # libvirt keeps <metadata> near the top; its position does not matter to the parser.
            root.insert(0, metadata)
        stash = metadata.find(_DETACHED)
        if stash is None:
            stash = ET.SubElement(metadata, _DETACHED)
        return stash

    @staticmethod
    def _drop_stash(root: ET.Element, stash: ET.Element) -> None:
        metadata = root.find("metadata")
        if metadata is not None:
            metadata.remove(stash)
            if not len(metadata):
                root.remove(metadata)
