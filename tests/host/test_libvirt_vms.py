"""LibvirtHypervisor against libvirt's own ``test:///default`` driver: real libvirt, real XML, no mocks.

The test driver keeps its state per process and shares it between connections, so each test defines its
domains under fresh names and the fixture removes them afterwards. Its ``shutdown`` is immediate unless the
domain says ``<on_poweroff>restart</on_poweroff>``, which plays a guest that ignores the ACPI request.
"""

from __future__ import annotations

import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pytest

from gpumode.host.libvirt_vms import LibvirtHypervisor, devices_of
from gpumode.host.root import Host
from gpumode.host.vms import HypervisorError, VmDevice, open_hypervisor

libvirt = pytest.importorskip("libvirt")

URI = "test:///default"
MDEV = "c0ffee00-1234-4321-8888-000000000001"


def domain_xml(name: str, *, hostdevs: str = "", on_poweroff: str = "destroy") -> str:
    return f"""<domain type='test'>
  <name>{name}</name><memory>1024</memory><os><type>hvm</type></os>
  <on_poweroff>{on_poweroff}</on_poweroff>
  <devices>{hostdevs}</devices>
</domain>"""


PCI_3B = """<hostdev mode='subsystem' type='pci' managed='yes'>
  <source><address domain='0x0000' bus='0x3b' slot='0x00' function='0x0'/></source><rom bar='off'/>
</hostdev>"""
PCI_3B_AUDIO = """<hostdev mode='subsystem' type='pci' managed='yes'>
  <source><address domain='0x0000' bus='0x3b' slot='0x00' function='0x1'/></source>
</hostdev>"""
MDEV_DEV = f"""<hostdev mode='subsystem' type='mdev' model='vfio-pci'>
  <source><address uuid='{MDEV.upper()}'/></source>
</hostdev>"""
USB_DEV = """<hostdev mode='subsystem' type='usb'>
  <source><vendor id='0x1234'/><product id='0xbeef'/></source>
</hostdev>"""


@pytest.fixture
def hv() -> Iterator[LibvirtHypervisor]:
    hypervisor = LibvirtHypervisor(URI, poll_interval=0.01)
    yield hypervisor
    conn = hypervisor.conn
    for dom in conn.listAllDomains(0):
        if dom.name().startswith("gm-"):
            if dom.isActive():
                dom.destroy()
            if dom.isPersistent():
                dom.undefine()
    hypervisor.close()


@pytest.fixture
def name() -> str:
    return f"gm-{uuid.uuid4().hex[:8]}"


def define(hv: LibvirtHypervisor, xml: str, *, running: bool = False) -> None:
    dom = hv.conn.defineXML(xml)
    if running:
        dom.create()


def persistent_xml(hv: LibvirtHypervisor, name: str) -> str:
    return str(hv.conn.lookupByName(name).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))


def test_list_vms_reads_pci_and_mdev_hostdevs_and_skips_others(hv: LibvirtHypervisor, name: str) -> None:
    define(hv, domain_xml(name, hostdevs=PCI_3B + USB_DEV + MDEV_DEV), running=True)
    define(hv, domain_xml(name + "-off"))

    vms = {vm.name: vm for vm in hv.list_vms()}

    assert vms[name].running is True
    assert vms[name].devices == [VmDevice("pci", "0000:3b:00.0"), VmDevice("mdev", MDEV)]
    assert vms[name].uuid == hv.conn.lookupByName(name).UUIDString()
    assert vms[name + "-off"].running is False
    assert vms[name + "-off"].devices == []


def test_devices_of_ignores_hostdev_without_a_usable_address() -> None:
    xml = """<domain><devices>
      <hostdev mode='subsystem' type='pci'><source/></hostdev>
      <hostdev mode='capabilities' type='storage'><source><block>/dev/sdb</block></source></hostdev>
      <hostdev mode='subsystem' type='pci'><source><address domain='0x0001' bus='0x81' slot='0x1f'
        function='0x7'/></source></hostdev>
    </devices></domain>"""
    assert devices_of(xml) == [VmDevice("pci", "0001:81:1f.7")]


def test_shutdown_stops_a_running_vm_and_is_a_no_op_when_stopped(hv: LibvirtHypervisor, name: str) -> None:
    define(hv, domain_xml(name), running=True)

    hv.shutdown(name, timeout=5)
    assert not hv.conn.lookupByName(name).isActive()

    hv.shutdown(name, timeout=5)  # already off: nothing to do, no error
    assert not hv.conn.lookupByName(name).isActive()


def test_shutdown_destroys_a_guest_that_ignores_the_request(hv: LibvirtHypervisor, name: str) -> None:
    # on_poweroff=restart: the test driver reboots the guest instead of stopping it (a guest ignoring ACPI).
    define(hv, domain_xml(name, on_poweroff="restart"), running=True)

    started = time.monotonic()
    hv.shutdown(name, timeout=0.2)

    assert not hv.conn.lookupByName(name).isActive()
    assert time.monotonic() - started >= 0.2  # it did wait for the graceful path first


def test_start_starts_a_stopped_vm_and_leaves_a_running_one(hv: LibvirtHypervisor, name: str) -> None:
    define(hv, domain_xml(name))
    hv.start(name)
    assert hv.conn.lookupByName(name).isActive()
    hv.start(name)
    assert hv.conn.lookupByName(name).isActive()


def test_unknown_vm_is_a_clear_error(hv: LibvirtHypervisor) -> None:
    with pytest.raises(HypervisorError, match="no VM named 'gm-missing'"):
        hv.start("gm-missing")


def test_detach_refuses_a_running_vm_and_changes_nothing(hv: LibvirtHypervisor, name: str) -> None:
    define(hv, domain_xml(name, hostdevs=PCI_3B), running=True)
    before = persistent_xml(hv, name)

    with pytest.raises(HypervisorError, match="running"):
        hv.detach_device(name, VmDevice("pci", "0000:3b:00.0"))

    assert persistent_xml(hv, name) == before


def test_detach_then_attach_restores_the_exact_hostdev(hv: LibvirtHypervisor, name: str) -> None:
    define(hv, domain_xml(name, hostdevs=PCI_3B + PCI_3B_AUDIO + MDEV_DEV))

    hv.detach_device(name, VmDevice("pci", "3b:00.0"))  # short form is accepted
    hv.detach_device(name, VmDevice("mdev", MDEV))

    vm = next(vm for vm in hv.list_vms() if vm.name == name)
    assert vm.devices == [VmDevice("pci", "0000:3b:00.1")]

    hv.attach_device(name, VmDevice("pci", "0000:3b:00.0"))
    hv.attach_device(name, VmDevice("mdev", MDEV))

    root = ET.fromstring(persistent_xml(hv, name))
    pci = [h for h in root.findall("devices/hostdev") if h.get("type") == "pci"]
    restored = next(h for h in pci if h.find("source/address").get("function") == "0x0")  # type: ignore[union-attr]
    assert restored.get("managed") == "yes"  # the original element, not a fresh one
    assert restored.find("rom") is not None
    assert root.find("metadata") is None  # nothing left stashed
    assert sorted(map(str, devices_of(persistent_xml(hv, name)))) == [
        "mdev:" + MDEV,
        "pci:0000:3b:00.0",
        "pci:0000:3b:00.1",
    ]


def test_stash_survives_a_new_hypervisor_object(hv: LibvirtHypervisor, name: str) -> None:
    """A crash between detach and rollback must not lose the original element: it lives in libvirt."""
    define(hv, domain_xml(name, hostdevs=PCI_3B))
    hv.detach_device(name, VmDevice("pci", "0000:3b:00.0"))

    other = LibvirtHypervisor(URI)
    other.attach_device(name, VmDevice("pci", "0000:3b:00.0"))
    other.close()

    restored = ET.fromstring(persistent_xml(hv, name)).find("devices/hostdev")
    assert restored is not None and restored.get("managed") == "yes"


def test_detach_absent_and_attach_present_are_no_ops(hv: LibvirtHypervisor, name: str) -> None:
    define(hv, domain_xml(name, hostdevs=PCI_3B))
    before = persistent_xml(hv, name)

    hv.detach_device(name, VmDevice("pci", "0000:5e:00.0"))
    hv.attach_device(name, VmDevice("pci", "0000:3b:00.0"))

    assert persistent_xml(hv, name) == before


def test_attach_new_devices_builds_unmanaged_pci_and_mdev_hostdevs(hv: LibvirtHypervisor, name: str) -> None:
    define(hv, domain_xml(name))

    hv.attach_device(name, VmDevice("pci", "0000:af:00.4"))
    hv.attach_device(name, VmDevice("mdev", MDEV))

    root = ET.fromstring(persistent_xml(hv, name))
    pci, mdev = root.findall("devices/hostdev")
    assert pci.get("managed") == "no"  # gpumode owns the vfio-pci binding, libvirt must not undo it
    assert mdev.get("model") == "vfio-pci"
    assert devices_of(persistent_xml(hv, name)) == [VmDevice("pci", "0000:af:00.4"), VmDevice("mdev", MDEV)]


def test_attach_rejects_a_bad_pci_address(hv: LibvirtHypervisor, name: str) -> None:
    define(hv, domain_xml(name))
    with pytest.raises(HypervisorError, match="not a PCI address"):
        hv.attach_device(name, VmDevice("pci", "3b:00"))


def test_open_hypervisor_picks_libvirt_on_a_real_host() -> None:
    hypervisor = open_hypervisor(Host("/"), URI)
    assert isinstance(hypervisor, LibvirtHypervisor)
    assert hypervisor.uri == URI
