"""The tree the emulated kernel lays out: paths, links, formats, config space (checked with lspci)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import H100, HDA, NIC, NV_VERSION, VGA, build, dev, make_spec, read
from gpumode.emulated.build import SpecError, create_kernel_tree
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.emulated.spec import DeviceSpec
from gpumode.host.root import Host


def test_device_dir_is_nested_by_topology_and_bus_entry_is_relative_link(dc: EmulatedKernel) -> None:
    link = dc.root / dev(H100)
    assert os.readlink(link) == f"../../../devices/pci0000:00/0000:00:01.0/{H100}"
    assert (dc.root / f"sys/devices/pci0000:00/0000:00:01.0/{H100}").is_dir()
    real = dc.root / f"sys/devices/pci0000:00/0000:00:01.0/{H100}"
    assert os.readlink(real / "driver") == "../../../../bus/pci/drivers/nvidia"
    assert os.readlink(real / "subsystem") == "../../../../bus/pci"
    assert os.readlink(real / "iommu_group") == "../../../../kernel/iommu_groups/10"
    bridge = dc.root / "sys/devices/pci0000:00/0000:00:01.0"
    assert os.readlink(bridge / "driver") == "../../../bus/pci/drivers/pcieport"
    back = dc.root / f"sys/kernel/iommu_groups/10/devices/{H100}"
    assert back.resolve() == real.resolve()
    assert (dc.root / f"sys/bus/pci/drivers/nvidia/{H100}").resolve() == real.resolve()


def test_attribute_formats(dc: EmulatedKernel) -> None:
    assert read(dc, dev(H100, "vendor")) == "0x10de\n"
    assert read(dc, dev(H100, "device")) == "0x2330\n"
    assert read(dc, dev(H100, "class")) == "0x030200\n"
    assert read(dc, dev(H100, "revision")) == "0xa1\n"
    assert read(dc, dev(H100, "subsystem_device")) == "0x16c1\n"
    assert read(dc, dev(H100, "numa_node")) == "0\n"
    assert read(dc, dev(H100, "driver_override")) == "(null)\n"
    assert read(dc, dev(H100, "modalias")) == "pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00\n"
    assert read(dc, dev(H100, "current_link_speed")) == "16.0 GT/s PCIe\n"
    assert len(read(dc, dev(H100, "resource")).splitlines()) == 13
    assert not (dc.root / dev(H100, "boot_vga")).exists()
    assert read(dc, dev(VGA, "boot_vga")) == "0\n"


def test_consumer_link_from_vga_to_its_audio_function(dc: EmulatedKernel) -> None:
    link = dc.root / dev(VGA, f"consumer:pci:{HDA}")
    assert os.path.islink(link)
    assert (link / "consumer").resolve() == (dc.root / dev(HDA)).resolve()


def test_sriov_capability_files_on_pf_only(dc: EmulatedKernel) -> None:
    assert read(dc, dev(NIC, "sriov_totalvfs")) == "4\n"
    assert read(dc, dev(NIC, "sriov_numvfs")) == "0\n"
    assert read(dc, dev(NIC, "sriov_offset")) == "2\n"
    assert read(dc, dev(NIC, "sriov_vf_device")) == "101c\n"
    assert read(dc, dev(NIC, "sriov_drivers_autoprobe")) == "1\n"
    assert not (dc.root / dev(H100, "sriov_totalvfs")).exists()


def test_proc_and_module_files(dc: EmulatedKernel) -> None:
    modules = read(dc, "proc/modules").splitlines()
    nv = next(line for line in modules if line.startswith("nvidia "))
    assert nv.split()[2:] == ["2", "nvidia_modeset,nvidia_uvm,", "Live", "0x0000000000000000", "(POE)"]
    assert "snd_hda_core 139264 2 snd_hda_intel,snd_hda_codec, Live 0x0000000000000000" in modules
    assert read(dc, "sys/module/nvidia/version") == f"{NV_VERSION}\n"
    assert read(dc, "sys/module/nvidia/refcnt") == "2\n"
    assert (
        os.readlink(dc.root / "sys/module/vfio_pci/drivers/pci:vfio-pci")
        == "../../../bus/pci/drivers/vfio-pci"
    )
    assert os.readlink(dc.root / "sys/bus/pci/drivers/vfio-pci/module") == "../../../../module/vfio_pci"
    assert read(dc, "proc/driver/nvidia/version").startswith(
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {NV_VERSION}  "
    )
    info = read(dc, f"proc/driver/nvidia/gpus/{H100}/information")
    assert "Model: \t\t NVIDIA H100 SXM5 80GB\n" in info
    assert f"Bus Location: \t {H100}\n" in info
    assert read(dc, f"proc/driver/nvidia/gpus/{H100}/unbindLock") == "0\n"
    assert read(dc, "proc/sys/kernel/osrelease") == "6.8.0-45-generic\n"
    assert read(dc, "etc/hostname") == "gpu-test-01\n"
    assert "intel_iommu=on" in read(dc, "proc/cmdline")


def test_modules_dep_has_real_format(dc: EmulatedKernel) -> None:
    dep = read(dc, "lib/modules/6.8.0-45-generic/modules.dep").splitlines()
    line = next(x for x in dep if x.startswith("kernel/drivers/vfio/pci/vfio-pci.ko:"))
    assert line.split(": ", 1)[1].split() == [
        "kernel/drivers/vfio/pci/vfio-pci-core.ko",
        "kernel/drivers/vfio/vfio.ko",
        "kernel/virt/lib/irqbypass.ko",
    ]
    ko = read(dc, "lib/modules/6.8.0-45-generic/kernel/drivers/vfio/pci/vfio-pci.ko")
    assert ko.startswith("gpumode-emulated-module v1\nname=vfio_pci\n")


def test_no_iommu_means_no_group_links(tmp_path: Path) -> None:
    k = build(tmp_path / "h", make_spec("datacenter", iommu=False))
    assert not os.path.lexists(k.root / dev(H100, "iommu_group"))
    assert not any((k.root / "sys/kernel/iommu_groups").iterdir())


def test_spec_device_without_driver_stays_unbound(tmp_path: Path) -> None:
    k = build(tmp_path / "h", make_spec(None))
    assert not os.path.lexists(k.root / dev(H100, "driver"))
    assert os.path.lexists(k.root / dev(HDA, "driver"))


def test_bad_spec_writes_nothing(tmp_path: Path) -> None:
    spec = make_spec("datacenter")
    spec.devices.append(DeviceSpec("0000:09:00.0", 0x10DE, 0x2330, 0x030200, parent="0000:00:77.0"))
    with pytest.raises(SpecError, match=r"parent 0000:00:77\.0"):
        create_kernel_tree(spec, tmp_path / "h")
    assert not (tmp_path / "h").exists()


def test_spec_driver_must_exist(tmp_path: Path) -> None:
    spec = make_spec("datacenter")
    spec.modules = [m for m in spec.modules if m != "mlx5_core"]
    with pytest.raises(SpecError, match="mlx5_core"):
        build(tmp_path / "h", spec)
    assert not (tmp_path / "h").exists()


def test_host_write_goes_through_the_emulated_kernel(dc: EmulatedKernel) -> None:
    host = Host(dc.root)
    assert host.emulated
    host.write(host.path(dev(H100, "driver_override")), "vfio-pci\n")
    assert read(dc, dev(H100, "driver_override")) == "vfio-pci\n"


def test_second_process_sees_state_written_by_first(dc: EmulatedKernel) -> None:
    dc.write(dev(H100, "driver/unbind"), H100)
    code = (
        "import sys; from gpumode.emulated.kernel import EmulatedKernel as K; k = K(sys.argv[1]); "
        f"assert k.snapshot().devices['{H100}'].driver is None; "
        f"k.write('sys/bus/pci/devices/{H100}/driver_override', 'vfio-pci')"
    )
    subprocess.run([sys.executable, "-c", code, str(dc.root)], check=True)
    assert dc.snapshot().devices[H100].driver_override == "vfio-pci"
    assert read(dc, dev(H100, "driver_override")) == "vfio-pci\n"


def test_resync_rebuilds_a_damaged_tree(dc: EmulatedKernel) -> None:
    shutil.rmtree(dc.root / "sys")
    dc.resync()
    assert read(dc, dev(H100, "vendor")) == "0x10de\n"


@pytest.mark.skipif(shutil.which("lspci") is None, reason="pciutils not installed")
def test_lspci_agrees_with_the_tree(dc: EmulatedKernel) -> None:
    dc.write(dev(NIC, "sriov_numvfs"), "2")
    out = subprocess.run(
        ["lspci", "-D", "-nn", "-k", "-A", "linux-sysfs", "-O", f"sysfs.path={dc.root}/sys/bus/pci"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    blocks: dict[str, str] = {}
    for block in out.split("\n0000:"):
        block = block if block.startswith("0000:") else "0000:" + block
        blocks[block[:12]] = block
    state = dc.snapshot()
    assert set(blocks) == {d.address for d in state.present_devices()}
    for d in state.present_devices():
        block = blocks[d.address]
        assert f"[{d.class_code >> 8:04x}]" in block.splitlines()[0]
        assert f"[{d.vendor:04x}:{d.device:04x}]" in block.splitlines()[0]
        if d.driver:
            assert f"Kernel driver in use: {d.driver}" in block
        else:
            assert "Kernel driver in use" not in block
    verbose = subprocess.run(
        [
            "lspci",
            "-vv",
            "-s",
            "0000:00:03.0",
            "-A",
            "linux-sysfs",
            "-O",
            f"sysfs.path={dc.root}/sys/bus/pci",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Bus: primary=00, secondary=03, subordinate=03" in verbose
