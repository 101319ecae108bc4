"""The emulated hypervisor: libvirt-shaped definitions; running VMs hold their devices through the kernel."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures.mini import T4, mini_host
from gpumode.emulated.hypervisor import EmulatedHypervisor
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.emulated.spec import VmSpec
from gpumode.host.root import Host
from gpumode.host.vms import Hypervisor as HypervisorProtocol
from gpumode.host.vms import HypervisorError, VmDevice, open_hypervisor

GPU = "0000:10:00.0"
PCI_GPU = VmDevice("pci", GPU)


def passthrough_host(tmp_path: Path, running: bool = True) -> Host:
    vms = [VmSpec("win11", running=running, hostdevs=(GPU,)), VmSpec("plain", running=True)]
    return create_host(mini_host("passthrough", vms=vms), tmp_path / "host")


def test_open_hypervisor_gives_the_emulated_one(tmp_path: Path) -> None:
    host = passthrough_host(tmp_path)
    hv: HypervisorProtocol = open_hypervisor(host)
    assert isinstance(hv, EmulatedHypervisor)
    vms = {vm.name: vm for vm in hv.list_vms()}
    assert vms["win11"].running and vms["win11"].devices == [PCI_GPU]
    assert vms["plain"].devices == [] and vms["plain"].uuid
    xml = (host.root / "etc/libvirt/qemu/win11.xml").read_text()
    assert '<hostdev mode="subsystem" type="pci" managed="no">' in xml
    assert 'bus="0x10"' in xml


def test_running_vm_holds_its_gpu_and_shutdown_releases_it(tmp_path: Path) -> None:
    host = passthrough_host(tmp_path)
    hv = EmulatedHypervisor(host)
    with pytest.raises(OSError) as busy:
        host.write(host.path("sys/bus/pci/drivers/vfio-pci/unbind"), GPU)
    assert (
        busy.value.errno == errno.EBUSY
        or os.path.basename(os.readlink(host.path("sys/bus/pci/devices", GPU, "driver"))) == "vfio-pci"
    )
    assert [h.holder for h in EmulatedKernel(host.root).handles()] == ["qemu:win11"]
    hv.shutdown("win11")
    hv.shutdown("win11")  # stopped: no-op
    assert EmulatedKernel(host.root).handles() == []
    assert not hv.list_vms()[1].running
    host.write(host.path("sys/bus/pci/drivers/vfio-pci/unbind"), GPU)


def test_start_fails_like_qemu_when_the_gpu_is_not_on_vfio(tmp_path: Path) -> None:
    host = passthrough_host(tmp_path, running=False)
    host.write(host.path("sys/bus/pci/drivers/vfio-pci/unbind"), GPU)
    hv = EmulatedHypervisor(host)
    with pytest.raises(HypervisorError, match=r"failed to start VM 'win11'.*vfio 0000:10:00.0"):
        hv.start("win11")
    assert not hv.is_running("win11") and EmulatedKernel(host.root).handles() == []


def test_start_fails_when_the_group_is_not_viable(tmp_path: Path) -> None:
    host = create_host(
        __import__("gpumode.emulated.fixtures.rtx_workstation", fromlist=["build"]).build(),
        tmp_path / "ws",
    )
    hv = EmulatedHypervisor(host)
    hv.shutdown("win11-cad")
    audio = "0000:01:00.1"
    host.write(host.path("sys/bus/pci/drivers/vfio-pci/unbind"), audio)
    assert host.run(["modprobe", "snd_hda_intel"]).ok
    host.write(host.path("sys/bus/pci/devices", audio, "driver_override"), "\n")
    host.write(host.path("sys/bus/pci/drivers_probe"), audio)
    assert os.path.basename(os.readlink(host.path("sys/bus/pci/devices", audio, "driver"))) == "snd_hda_intel"
    hv.detach_device("win11-cad", VmDevice("pci", audio))
    with pytest.raises(HypervisorError, match="not viable"):
        hv.start("win11-cad")


def test_mdev_vm_holds_the_mdev(tmp_path: Path) -> None:
    uuid = "3b2f6d8e-5d7c-4a3e-9a57-0d2f0b1c9e11"
    spec = mini_host("vgpu", T4, services=False, vms=[VmSpec("vdi", running=False, mdevs=(uuid,))])
    spec.mdevs = [(GPU, 232, uuid)]  # GRID T4-4Q
    host = create_host(spec, tmp_path / "t4")
    hv = EmulatedHypervisor(host)
    hv.start("vdi")
    with pytest.raises(OSError) as busy:
        host.write(host.path("sys/bus/mdev/devices", uuid, "remove"), "1")
    assert busy.value.errno == errno.EBUSY
    hv.shutdown("vdi")
    host.write(host.path("sys/bus/mdev/devices", uuid, "remove"), "1")
    with pytest.raises(HypervisorError, match="vfio " + uuid):
        hv.start("vdi")  # its mdev is gone


def test_detach_and_attach_need_a_stopped_vm(tmp_path: Path) -> None:
    host = passthrough_host(tmp_path)
    hv = EmulatedHypervisor(host)
    with pytest.raises(HypervisorError, match="running"):
        hv.detach_device("win11", PCI_GPU)
    hv.shutdown("win11")
    hv.detach_device("win11", PCI_GPU)
    hv.detach_device("win11", PCI_GPU)  # absent: no-op
    assert next(vm for vm in hv.list_vms() if vm.name == "win11").devices == []
    hv.attach_device("win11", PCI_GPU)
    hv.attach_device("win11", PCI_GPU)  # present: no-op
    assert next(vm for vm in hv.list_vms() if vm.name == "win11").devices == [PCI_GPU]
    hv.start("win11")
    assert hv.is_running("win11")


def test_bad_names_and_devices(tmp_path: Path) -> None:
    hv = EmulatedHypervisor(passthrough_host(tmp_path, running=False))
    with pytest.raises(HypervisorError, match="Domain not found"):
        hv.start("nope")
    with pytest.raises(HypervisorError, match="bad PCI device"):
        hv.attach_device("win11", VmDevice("pci", "10:00"))
    with pytest.raises(HypervisorError, match="already exists"):
        hv.define("win11", [])
