"""sriov_numvfs: errnos, VF creation (addresses, links, groups, autoprobe) and removal."""

from __future__ import annotations

import errno
import os

import pytest

from conftest import L40S, NIC, dev, read
from gpumode.emulated.kernel import EmulatedKernel


def errno_of(kernel: EmulatedKernel, path: str, value: str) -> int:
    with pytest.raises(OSError) as info:
        kernel.write(path, value)
    assert info.value.errno is not None
    return info.value.errno


def test_nvidia_bound_pf_cannot_configure_sriov(dc: EmulatedKernel) -> None:
    assert errno_of(dc, dev(L40S, "sriov_numvfs"), "4") == errno.ENOENT


def test_unbound_pf_is_enoent_and_bad_values(dc: EmulatedKernel) -> None:
    dc.write(dev(L40S, "driver/unbind"), L40S)
    assert errno_of(dc, dev(L40S, "sriov_numvfs"), "2") == errno.ENOENT
    assert errno_of(dc, dev(L40S, "sriov_numvfs"), "5") == errno.ERANGE
    assert errno_of(dc, dev(L40S, "sriov_numvfs"), "two") == errno.EINVAL


def pf_stub(k: EmulatedKernel, address: str) -> None:
    """sriov-manage's dance: unbind, new_id + bind to pci-pf-stub."""
    k.write(dev(address, "driver/unbind"), address)
    k.write("sys/bus/pci/drivers/pci-pf-stub/new_id", "10de 26b9")


def test_pf_stub_enables_vfs_as_siblings_with_links(dc: EmulatedKernel) -> None:
    pf_stub(dc, L40S)
    assert os.readlink(dc.root / dev(L40S, "driver")).endswith("/pci-pf-stub")
    dc.write(dev(L40S, "sriov_numvfs"), "4")
    vfs = ["0000:05:00.4", "0000:05:00.5", "0000:05:00.6", "0000:05:00.7"]
    for n, vf in enumerate(vfs):
        assert os.readlink(dc.root / dev(L40S, f"virtfn{n}")) == f"../{vf}"
        assert os.readlink(dc.root / dev(vf, "physfn")) == f"../{L40S}"
        assert os.readlink(dc.root / dev(vf)) == f"../../../devices/pci0000:00/0000:00:05.0/{vf}"
        assert not (dc.root / dev(vf, "remove")).exists()
        assert os.readlink(dc.root / dev(vf, "driver")).endswith("/nvidia")  # autoprobed
    groups = {os.readlink(dc.root / dev(vf, "iommu_group")) for vf in vfs}
    assert len(groups) == 4
    assert read(dc, dev(L40S, "sriov_numvfs")) == "4\n"
    assert errno_of(dc, dev(L40S, "sriov_numvfs"), "2") == errno.EBUSY
    dc.write(dev(L40S, "sriov_numvfs"), "4")  # equal: no-op
    dc.write(dev(L40S, "sriov_numvfs"), "0")
    assert not any(os.path.lexists(dc.root / dev(vf)) for vf in vfs)
    assert not os.path.lexists(dc.root / dev(L40S, "virtfn0"))


def test_sriov_drivers_autoprobe_zero_keeps_vfs_unbound(dc: EmulatedKernel) -> None:
    dc.write(dev(NIC, "sriov_drivers_autoprobe"), "0")
    dc.write(dev(NIC, "sriov_numvfs"), "2")
    vf = "0000:03:00.2"
    assert read(dc, dev(vf, "device")) == "0x101c\n"
    assert not os.path.lexists(dc.root / dev(vf, "driver"))
    assert errno_of(dc, "sys/bus/pci/drivers/mlx5_core/bind", vf) == errno.ENODEV
    dc.write(dev(vf, "driver_override"), "mlx5_core")
    dc.write("sys/bus/pci/drivers/mlx5_core/bind", vf)


def test_disabling_vfs_destroys_their_vgpus(vgpu: EmulatedKernel) -> None:
    pf_stub(vgpu, L40S)
    vgpu.write(dev(L40S, "sriov_numvfs"), "2")
    vgpu.write(dev("0000:05:00.4", "nvidia/current_vgpu_type"), "1150")
    vgpu.write(dev(L40S, "sriov_numvfs"), "0")
    assert all(d.vgpu_type == 0 for d in vgpu.snapshot().devices.values())
