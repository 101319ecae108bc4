"""Driver binding writes: errnos and side effects of bind, unbind, driver_override, drivers_probe, new_id."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from conftest import H100, HDA, NIC, VGA, build, dev, make_spec, read
from gpumode.emulated.kernel import EmulatedKernel


def errno_of(kernel: EmulatedKernel, path: str, value: str) -> int:
    with pytest.raises(OSError) as info:
        kernel.write(path, value)
    assert info.value.errno is not None
    return info.value.errno


@pytest.fixture
def bare(tmp_path: Path) -> EmulatedKernel:
    """No nvidia driver at all: GPUs unbound."""
    return build(tmp_path / "host", make_spec(None), None)


def to_vfio(k: EmulatedKernel, address: str) -> None:
    """libvirt's recipe: override, unbind if bound, drivers_probe."""
    k.write(dev(address, "driver_override"), "vfio-pci")
    if os.path.lexists(k.root / dev(address, "driver")):
        k.write(dev(address, "driver/unbind"), address)
    k.write("sys/bus/pci/drivers_probe", address)


def test_bind_to_bound_device_is_ebusy(dc: EmulatedKernel) -> None:
    assert errno_of(dc, "sys/bus/pci/drivers/nvidia/bind", H100) == errno.EBUSY


def test_bind_non_matching_driver_is_enodev(bare: EmulatedKernel) -> None:
    assert errno_of(bare, "sys/bus/pci/drivers/mlx5_core/bind", H100) == errno.ENODEV
    assert errno_of(bare, "sys/bus/pci/drivers/vfio-pci/bind", H100) == errno.ENODEV  # override-only
    assert errno_of(bare, "sys/bus/pci/drivers/pci-stub/bind", "0000:77:00.0") == errno.ENODEV


def test_unbind_from_other_driver_is_enodev(dc: EmulatedKernel) -> None:
    assert errno_of(dc, "sys/bus/pci/drivers/snd_hda_intel/unbind", H100) == errno.ENODEV


def test_unbind_removes_links(dc: EmulatedKernel) -> None:
    dc.write("sys/bus/pci/drivers/nvidia/unbind", H100 + "\n")
    assert not os.path.lexists(dc.root / dev(H100, "driver"))
    assert not os.path.lexists(dc.root / f"sys/bus/pci/drivers/nvidia/{H100}")
    assert not (dc.root / f"proc/driver/nvidia/gpus/{H100}").exists()


def test_driver_override_formats_and_does_not_unbind(dc: EmulatedKernel) -> None:
    dc.write(dev(H100, "driver_override"), "vfio-pci\nignored")
    assert read(dc, dev(H100, "driver_override")) == "vfio-pci\n"
    assert os.readlink(dc.root / dev(H100, "driver")).endswith("/nvidia")
    dc.write(dev(H100, "driver_override"), "\n")
    assert read(dc, dev(H100, "driver_override")) == "(null)\n"
    assert errno_of(dc, dev(H100, "driver_override"), "x" * 4095) == errno.EINVAL


def test_override_then_drivers_probe_binds_vfio_with_its_nodes(bare: EmulatedKernel) -> None:
    to_vfio(bare, H100)
    assert os.readlink(bare.root / dev(H100, "driver")).endswith("/vfio-pci")
    assert (bare.root / dev(H100, "vfio-dev/vfio0")).is_dir()
    assert (bare.root / "dev/vfio/10").exists()
    assert (bare.root / "dev/vfio/devices/vfio0").exists()
    bare.write("sys/bus/pci/drivers/vfio-pci/unbind", H100)
    assert not (bare.root / dev(H100, "vfio-dev")).exists()
    assert not (bare.root / "dev/vfio/10").exists()


def test_override_to_other_driver_blocks_matching(bare: EmulatedKernel) -> None:
    bare.write(dev(HDA, "driver/unbind"), HDA)
    bare.write(dev(HDA, "driver_override"), "none")
    assert errno_of(bare, "sys/bus/pci/drivers/snd_hda_intel/bind", HDA) == errno.ENODEV
    bare.write("sys/bus/pci/drivers_probe", HDA)  # succeeds although nothing binds
    assert not os.path.lexists(bare.root / dev(HDA, "driver"))


def test_drivers_probe_unknown_device_is_enodev(dc: EmulatedKernel) -> None:
    assert errno_of(dc, "sys/bus/pci/drivers_probe", "0000:77:00.0") == errno.ENODEV


def test_kernel_driver_bind_into_vfio_owned_group_is_ebusy(bare: EmulatedKernel) -> None:
    bare.write(dev(HDA, "driver/unbind"), HDA)
    to_vfio(bare, VGA)
    bare.open_handle("vm-a", "vfio", VGA)
    assert errno_of(bare, "sys/bus/pci/drivers/snd_hda_intel/bind", HDA) == errno.EBUSY
    bare.write("sys/bus/pci/drivers_probe", HDA)  # probe fails quietly
    assert not os.path.lexists(bare.root / dev(HDA, "driver"))
    bare.close_handle("vm-a", "vfio", VGA)
    bare.write("sys/bus/pci/drivers/snd_hda_intel/bind", HDA)


def test_vfio_open_needs_a_viable_group(bare: EmulatedKernel) -> None:
    to_vfio(bare, VGA)  # HDA still on snd_hda_intel
    assert not bare.iommu_group_viable(11)
    with pytest.raises(OSError, match="not viable") as info:
        bare.open_handle("vm-a", "vfio", VGA)
    assert info.value.errno == errno.EBUSY
    to_vfio(bare, HDA)
    bare.open_handle("vm-a", "vfio", VGA)
    with pytest.raises(OSError) as other:
        bare.open_handle("vm-b", "vfio", HDA)
    assert other.value.errno == errno.EBUSY


def test_unbind_vfio_while_vm_holds_it_is_ebusy(bare: EmulatedKernel) -> None:
    to_vfio(bare, H100)
    bare.open_handle("vm-a", "vfio", H100)
    assert errno_of(bare, "sys/bus/pci/drivers/vfio-pci/unbind", H100) == errno.EBUSY
    assert bare.close_all("vm-a") == 1
    bare.write("sys/bus/pci/drivers/vfio-pci/unbind", H100)


def test_vfio_bind_without_iommu_fails(tmp_path: Path) -> None:
    k = build(tmp_path / "h", make_spec(None, iommu=False), None)
    k.write(dev(H100, "driver_override"), "vfio-pci")
    assert errno_of(k, "sys/bus/pci/drivers/vfio-pci/bind", H100) == errno.EINVAL


def test_new_id_binds_every_unbound_match_and_remove_id(bare: EmulatedKernel) -> None:
    bare.write("sys/bus/pci/drivers/pci-stub/new_id", "10de 2330")
    assert os.readlink(bare.root / dev(H100, "driver")).endswith("/pci-stub")
    assert errno_of(bare, "sys/bus/pci/drivers/pci-stub/new_id", "10de 2330") == errno.EEXIST
    assert errno_of(bare, "sys/bus/pci/drivers/pci-stub/new_id", "10de") == errno.EINVAL
    assert (
        errno_of(bare, "sys/bus/pci/drivers/pci-stub/new_id", "10de 2330 ffffffff ffffffff 0 0 5")
        == errno.EINVAL
    )
    bare.write("sys/bus/pci/drivers/pci-stub/remove_id", "10de 2330")
    assert errno_of(bare, "sys/bus/pci/drivers/pci-stub/remove_id", "10de 2330") == errno.ENODEV
    assert errno_of(bare, "sys/bus/pci/drivers/pci-stub/remove_id", "zz") == errno.EINVAL


def test_drivers_autoprobe_off_keeps_new_devices_unbound(dc: EmulatedKernel) -> None:
    dc.write("sys/bus/pci/drivers_autoprobe", "0")
    assert read(dc, "sys/bus/pci/drivers_autoprobe") == "0\n"
    dc.write(dev(NIC, "sriov_numvfs"), "1")
    assert not os.path.lexists(dc.root / dev("0000:03:00.2", "driver"))


def test_remove_and_rescan(dc: EmulatedKernel) -> None:
    dc.write("sys/bus/pci/devices/0000:00:02.0/remove", "1")
    assert not os.path.lexists(dc.root / dev(VGA))
    assert not os.path.lexists(dc.root / dev(HDA))
    assert not (dc.root / "sys/devices/pci0000:00/0000:00:02.0").exists()
    dc.write("sys/bus/pci/rescan", "1")
    assert os.readlink(dc.root / dev(VGA, "driver")).endswith("/nvidia")
    assert os.readlink(dc.root / dev(HDA, "driver")).endswith("/snd_hda_intel")
    assert errno_of(dc, dev(VGA, "remove"), "yes") == errno.EINVAL


def test_device_rescan_readds_siblings(dc: EmulatedKernel) -> None:
    dc.write(dev(HDA, "remove"), "1")
    dc.write(dev(VGA, "rescan"), "1")
    assert os.path.lexists(dc.root / dev(HDA))


def test_enable_with_driver_is_ebusy(dc: EmulatedKernel) -> None:
    assert errno_of(dc, dev(H100, "enable"), "1") == errno.EBUSY
    dc.write(dev(H100, "driver/unbind"), H100)
    assert errno_of(dc, dev(H100, "enable"), "0") == errno.EIO
    dc.write(dev(H100, "enable"), "1")
    assert read(dc, dev(H100, "enable")) == "1\n"


def test_read_only_and_missing_paths(dc: EmulatedKernel) -> None:
    with pytest.raises(PermissionError):
        dc.write(dev(H100, "vendor"), "0x1234")
    with pytest.raises(FileNotFoundError):
        dc.write(dev(H100, "no_such_attr"), "1")
    with pytest.raises(IsADirectoryError):
        dc.write(dev(H100), "1")
    assert read(dc, dev(H100, "vendor")) == "0x10de\n"


def test_failed_write_changes_nothing(dc: EmulatedKernel) -> None:
    before = (dc.root / ".gpumode-emulated/state.json").read_text()
    errno_of(dc, "sys/bus/pci/drivers/nvidia/bind", H100)
    assert (dc.root / ".gpumode-emulated/state.json").read_text() == before


def test_injected_fault_fails_next_write_once(dc: EmulatedKernel) -> None:
    dc.inject_fault(dev(H100, "driver/unbind"), errno.EIO)
    assert errno_of(dc, "sys/bus/pci/drivers/nvidia/unbind", H100) == errno.EIO
    dc.write("sys/bus/pci/drivers/nvidia/unbind", H100)
    assert not os.path.lexists(dc.root / dev(H100, "driver"))
