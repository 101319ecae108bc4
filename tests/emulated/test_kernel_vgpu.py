"""vGPU: mdev types and devices (pre-Ada), the vendor interface on VFs (vGPU 17+), unbindLock."""

from __future__ import annotations

import errno
import os

import pytest

from conftest import H100, L40S, T4, dev, read
from gpumode.emulated.kernel import EmulatedKernel

U1 = "11111111-2222-3333-4444-555555555555"
U2 = "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
T4_TYPES = f"{dev(T4)}/mdev_supported_types"
VF0, VF1 = "0000:05:00.4", "0000:05:00.5"


def errno_of(kernel: EmulatedKernel, path: str, value: str) -> int:
    with pytest.raises(OSError) as info:
        kernel.write(path, value)
    assert info.value.errno is not None
    return info.value.errno


def test_no_mdev_types_under_the_datacenter_driver(dc: EmulatedKernel) -> None:
    assert os.readlink(dc.root / dev(T4, "driver")).endswith("/nvidia")
    assert not (dc.root / T4_TYPES).exists()
    assert not (dc.root / "sys/class/mdev_bus").exists()


def test_mdev_types_under_the_vgpu_manager(vgpu: EmulatedKernel) -> None:
    assert read(vgpu, f"{T4_TYPES}/nvidia-222/name") == "GRID T4-1Q\n"
    assert read(vgpu, f"{T4_TYPES}/nvidia-222/available_instances") == "16\n"
    assert read(vgpu, f"{T4_TYPES}/nvidia-222/device_api") == "vfio-pci\n"
    assert "framebuffer=1024M" in read(vgpu, f"{T4_TYPES}/nvidia-222/description")
    assert (vgpu.root / f"sys/class/mdev_bus/{T4}").resolve() == (vgpu.root / dev(T4)).resolve()
    assert not (vgpu.root / dev(L40S, "mdev_supported_types")).exists()  # vendor-interface model


def test_mdev_create_links_and_errnos(vgpu: EmulatedKernel) -> None:
    vgpu.write(f"sys/class/mdev_bus/{T4}/mdev_supported_types/nvidia-223/create", U1.upper() + "\n")
    mdev = vgpu.root / dev(T4, U1)
    assert mdev.is_dir()
    assert os.readlink(mdev / "mdev_type") == "../mdev_supported_types/nvidia-223"
    assert (vgpu.root / f"sys/bus/mdev/devices/{U1}").resolve() == mdev.resolve()
    assert (vgpu.root / f"{T4_TYPES}/nvidia-223/devices/{U1}").resolve() == mdev.resolve()
    group = os.readlink(mdev / "iommu_group").rsplit("/", 1)[1]
    assert (vgpu.root / f"dev/vfio/{group}").exists()
    assert read(vgpu, f"{T4_TYPES}/nvidia-223/available_instances") == "7\n"
    assert errno_of(vgpu, f"{T4_TYPES}/nvidia-223/create", U1) == errno.EEXIST
    assert errno_of(vgpu, f"{T4_TYPES}/nvidia-223/create", "not-a-uuid") == errno.EINVAL
    assert errno_of(vgpu, f"{T4_TYPES}/nvidia-223/create", "z" * 36) == errno.EINVAL


def test_heterogeneous_sizes_are_not_creatable(vgpu: EmulatedKernel) -> None:
    vgpu.write(f"{T4_TYPES}/nvidia-223/create", U1)
    assert read(vgpu, f"{T4_TYPES}/nvidia-222/available_instances") == "0\n"
    assert read(vgpu, f"{T4_TYPES}/nvidia-230/available_instances") == "7\n"  # same 2 GiB framebuffer
    assert errno_of(vgpu, f"{T4_TYPES}/nvidia-222/create", U2) == errno.EUSERS


def test_mdev_remove(vgpu: EmulatedKernel) -> None:
    vgpu.write(f"{T4_TYPES}/nvidia-223/create", U1)
    vgpu.open_handle("vm-a", "mdev", U1)
    assert errno_of(vgpu, f"sys/bus/mdev/devices/{U1}/remove", "1") == errno.EBUSY
    vgpu.close_handle("vm-a", "mdev", U1)
    assert errno_of(vgpu, f"sys/bus/mdev/devices/{U1}/remove", "yes") == errno.EINVAL
    vgpu.write(f"sys/bus/mdev/devices/{U1}/remove", "1")
    assert not os.path.lexists(vgpu.root / f"sys/bus/mdev/devices/{U1}")


def test_unbinding_nvidia_destroys_mdevs_and_types(vgpu: EmulatedKernel) -> None:
    vgpu.write(f"{T4_TYPES}/nvidia-223/create", U1)
    vgpu.write(dev(T4, "driver/unbind"), T4)
    assert not os.path.lexists(vgpu.root / f"sys/bus/mdev/devices/{U1}")
    assert not (vgpu.root / T4_TYPES).exists()
    assert not os.path.lexists(vgpu.root / f"sys/class/mdev_bus/{T4}")


def test_unbinding_parent_of_open_mdev_is_ebusy(vgpu: EmulatedKernel) -> None:
    vgpu.write(f"{T4_TYPES}/nvidia-223/create", U1)
    vgpu.open_handle("vm-a", "mdev", U1)
    assert errno_of(vgpu, dev(T4, "driver/unbind"), T4) == errno.EBUSY


def vendor_vfs(k: EmulatedKernel) -> None:
    k.write(dev(L40S, "driver/unbind"), L40S)
    k.write("sys/bus/pci/drivers/pci-pf-stub/new_id", "10de 26b9")
    k.write(dev(L40S, "sriov_numvfs"), "4")


def test_vendor_interface_formats_and_errnos(vgpu: EmulatedKernel) -> None:
    vendor_vfs(vgpu)
    assert not (vgpu.root / dev(L40S, "nvidia")).exists()
    creatable = read(vgpu, dev(VF0, "nvidia/creatable_vgpu_types"))
    assert creatable == "ID    : vGPU Name\n1150  : NVIDIA L40S-12Q\n1151  : NVIDIA L40S-24Q\n"
    assert read(vgpu, dev(VF0, "nvidia/current_vgpu_type")) == "0\n"
    assert errno_of(vgpu, dev(VF0, "nvidia/current_vgpu_type"), "0") == errno.EPERM
    assert errno_of(vgpu, dev(VF0, "nvidia/current_vgpu_type"), "abc") == errno.EINVAL
    assert errno_of(vgpu, dev(VF0, "nvidia/current_vgpu_type"), "999") == errno.EINVAL
    vgpu.write(dev(VF0, "nvidia/current_vgpu_type"), "1151\n")
    assert read(vgpu, dev(VF0, "nvidia/current_vgpu_type")) == "1151\n"
    assert errno_of(vgpu, dev(VF0, "nvidia/current_vgpu_type"), "1151") == errno.EPERM
    # siblings shrink: same size only, and 24Q allows two per GPU
    assert (
        read(vgpu, dev(VF1, "nvidia/creatable_vgpu_types")) == "ID    : vGPU Name\n1151  : NVIDIA L40S-24Q\n"
    )
    vgpu.write(dev(VF1, "nvidia/current_vgpu_type"), "1151")
    assert read(vgpu, dev("0000:05:00.6", "nvidia/creatable_vgpu_types")) == "ID    : vGPU Name\n"
    assert (vgpu.root / dev(VF0, "vfio-dev")).is_dir()


def test_clearing_type_of_open_vf_is_ebusy(vgpu: EmulatedKernel) -> None:
    vendor_vfs(vgpu)
    with pytest.raises(OSError) as info:
        vgpu.open_handle("vm-a", "vfio", VF0)  # no type yet
    assert info.value.errno == errno.ENODEV
    vgpu.write(dev(VF0, "nvidia/current_vgpu_type"), "1150")
    vgpu.open_handle("vm-a", "vfio", VF0)
    assert errno_of(vgpu, dev(VF0, "nvidia/current_vgpu_type"), "0") == errno.EBUSY
    vgpu.close_all("vm-a")
    vgpu.write(dev(VF0, "nvidia/current_vgpu_type"), "0")
    assert read(vgpu, dev(VF0, "nvidia/current_vgpu_type")) == "0\n"


def test_unbind_lock_and_busy_gpu(dc: EmulatedKernel) -> None:
    lock = f"proc/driver/nvidia/gpus/{H100}/unbindLock"
    dc.open_handle("nvidia-persistenced", "nvidia", H100)
    dc.write(lock, "1")
    assert read(dc, lock) == "0\n"  # a client holds the GPU: lock not taken
    assert errno_of(dc, dev(H100, "driver/unbind"), H100) == errno.EBUSY
    dc.close_handle("nvidia-persistenced", "nvidia", H100)
    dc.write(lock, "1")
    assert read(dc, lock) == "1\n"
    with pytest.raises(OSError) as info:
        dc.open_handle("cuda-job", "nvidia", H100)
    assert info.value.errno == errno.EBUSY
    dc.write(lock, "0")
    assert read(dc, lock) == "0\n"
    dc.write(lock, "1")
    dc.write(dev(H100, "driver/unbind"), H100)
    assert not os.path.lexists(dc.root / dev(H100, "driver"))
