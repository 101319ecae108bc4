"""Modules: load with dependencies, flavour exclusivity, unload in use, side effects, module files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from conftest import H100, L40S, NV_VERSION, T4, build, dev, make_spec, read
from gpumode.emulated import modules
from gpumode.emulated.kernel import EmulatedKernel


@pytest.fixture
def bare(tmp_path: Path) -> EmulatedKernel:
    return build(tmp_path / "host", make_spec(None), None)


def test_load_unknown_module_is_enoent(dc: EmulatedKernel) -> None:
    with pytest.raises(FileNotFoundError):
        dc.load_module("no_such_module")


def test_load_module_loads_deps_registers_driver_and_autoprobes(bare: EmulatedKernel) -> None:
    modules.install_module_files(bare.root, modules.nvidia_module_files("datacenter", NV_VERSION))
    assert bare.load_module("nvidia_drm") == [
        "nvidia",
        "nvidia_modeset",
        "drm",
        "drm_kms_helper",
        "nvidia_drm",
    ]
    assert bare.load_module("nvidia") == []
    assert os.readlink(bare.root / dev(H100, "driver")).endswith("/nvidia")
    assert (bare.root / "dev/nvidiactl").exists()
    assert bare.module_refcount("nvidia") == 1


def test_vgpu_and_datacenter_nvidia_never_both_loaded(dc: EmulatedKernel) -> None:
    modules.install_module_files(dc.root, modules.nvidia_module_files("vgpu", "550.90.05"))
    with pytest.raises(OSError) as info:
        dc.load_module("nvidia_vgpu_vfio")
    assert info.value.errno == errno.ENOENT
    assert "nvidia_vgpu_vfio" not in dc.loaded_modules()


def test_rmmod_in_use_is_ebusy(dc: EmulatedKernel) -> None:
    with pytest.raises(OSError) as info:
        dc.unload_module("nvidia")  # held by nvidia_uvm and nvidia_modeset
    assert info.value.errno == errno.EBUSY
    dc.unload_module("nvidia_uvm")
    dc.unload_module("nvidia_modeset")
    dc.open_handle("nvidia-persistenced", "nvidia", H100)
    with pytest.raises(OSError) as busy:
        dc.unload_module("nvidia")
    assert busy.value.errno == errno.EBUSY
    dc.close_all("nvidia-persistenced")
    dc.unload_module("nvidia")
    assert not os.path.lexists(dc.root / dev(H100, "driver"))
    assert not (dc.root / "sys/bus/pci/drivers/nvidia").exists()
    assert not (dc.root / "sys/module/nvidia").exists()
    assert not (dc.root / "proc/driver/nvidia").exists()
    assert "nvidia " not in read(dc, "proc/modules")


def test_rmmod_not_loaded_is_enoent(dc: EmulatedKernel) -> None:
    with pytest.raises(OSError) as info:
        dc.unload_module("nouveau")
    assert info.value.errno == errno.ENOENT


def test_unloading_vgpu_manager_destroys_vgpus(vgpu: EmulatedKernel) -> None:
    uuid = "11111111-2222-3333-4444-555555555555"
    vgpu.write(f"{dev(T4)}/mdev_supported_types/nvidia-222/create", uuid)
    vgpu.open_handle("vm-a", "mdev", uuid)
    with pytest.raises(OSError) as info:
        vgpu.unload_module("nvidia_vgpu_vfio")
    assert info.value.errno == errno.EBUSY
    vgpu.close_all("vm-a")
    vgpu.unload_module("nvidia_vgpu_vfio")
    assert not vgpu.snapshot().mdevs
    assert not (vgpu.root / f"{dev(T4)}/mdev_supported_types").exists()


def test_module_files_install_and_remove(bare: EmulatedKernel) -> None:
    release = "lib/modules/6.8.0-45-generic"
    modules.install_module_files(bare.root, modules.nvidia_module_files("vgpu", "550.90.05", open_build=True))
    assert "updates/dkms/nvidia-vgpu-vfio.ko: " in read(bare, f"{release}/modules.dep")
    bare.load_module("nvidia")
    assert read(bare, "proc/driver/nvidia/version").startswith(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.90.05  "
    )
    assert " (OE)" in read(bare, "proc/modules")
    modules.remove_module_files(bare.root, ["nvidia", "nvidia_vgpu_vfio"])
    assert "updates/dkms" not in read(bare, f"{release}/modules.dep")
    assert read(bare, "sys/module/nvidia/version") == "550.90.05\n"  # the loaded copy stays
    with pytest.raises(FileNotFoundError):
        bare.load_module("nvidia_vgpu_vfio")


def test_matching_modules_is_the_modalias_lookup(dc: EmulatedKernel) -> None:
    assert dc.matching_modules(L40S) == ["nouveau", "nvidia"]


def test_injected_module_fault(dc: EmulatedKernel) -> None:
    dc.inject_fault("unload:nvidia_uvm", errno.EBUSY)
    with pytest.raises(OSError):
        dc.unload_module("nvidia_uvm")
    dc.unload_module("nvidia_uvm")


def test_reboot_leaves_cold_hardware(vgpu: EmulatedKernel) -> None:
    vgpu.write(f"{dev(T4)}/mdev_supported_types/nvidia-222/create", "11111111-2222-3333-4444-555555555555")
    vgpu.reboot()
    assert vgpu.loaded_modules() == []
    assert not vgpu.snapshot().mdevs
    assert not os.path.lexists(vgpu.root / dev(T4, "driver"))
    assert os.readlink(vgpu.root / dev("0000:00:01.0", "driver")).endswith("/pcieport")
    assert read(vgpu, "proc/modules") == ""
