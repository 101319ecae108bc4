"""A small host for the emulated-kernel tests: bridges, a 3D GPU, a VGA GPU with its HDA function, an SR-IOV
NIC, an mdev-vGPU GPU (T4) and a vendor-vGPU SR-IOV GPU (L40S). The real fixtures live in
emulated/fixtures/."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from gpumode.emulated.build import create_kernel_tree
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.emulated.modules import nvidia_module_files
from gpumode.emulated.spec import DeviceSpec, GpuModelSpec, HostSpec, VgpuTypeSpec
from host_templates import HostTemplates

H100 = "0000:01:00.0"
VGA = "0000:02:00.0"
HDA = "0000:02:00.1"
NIC = "0000:03:00.0"
T4 = "0000:04:00.0"
L40S = "0000:05:00.0"
L40S_VF0 = "0000:05:00.4"
NV_VERSION = "550.90.07"

MODELS = {
    "h100": GpuModelSpec(key="h100", device=0x2330, subsystem_device=0x16C1, class_code=0x030200),
    "a6000": GpuModelSpec(key="a6000", device=0x2230, subsystem_device=0x1459, class_code=0x030000),
    "t4": GpuModelSpec(
        key="t4",
        device=0x1EB8,
        subsystem_device=0x12A2,
        class_code=0x030200,
        vgpu_interface="mdev",
        vgpu_types=(
            VgpuTypeSpec(222, "GRID T4-1Q", 1024, 16),
            VgpuTypeSpec(223, "GRID T4-2Q", 2048, 8),
            VgpuTypeSpec(230, "GRID T4-2B", 2048, 8),
        ),
    ),
    "l40s": GpuModelSpec(
        key="l40s",
        device=0x26B9,
        subsystem_device=0x1851,
        class_code=0x030200,
        sriov_total_vfs=4,
        vf_offset=4,
        vgpu_interface="vendor",
        vgpu_types=(
            VgpuTypeSpec(1150, "NVIDIA L40S-12Q", 12288, 4),
            VgpuTypeSpec(1151, "NVIDIA L40S-24Q", 24576, 2),
        ),
    ),
}


def bridge(address: str, group: int) -> DeviceSpec:
    return DeviceSpec(address, 0x8086, 0x1901, 0x060400, iommu_group=group, driver="pcieport")


def devices(gpu_driver: str | None, *, hda_driver: str | None = "snd_hda_intel") -> list[DeviceSpec]:
    nv = 0x10DE
    return [
        bridge("0000:00:01.0", 1),
        DeviceSpec(H100, nv, 0x2330, 0x030200, 0xA1, nv, 0x16C1, "0000:00:01.0", 0, 10, gpu_driver, "h100"),
        bridge("0000:00:02.0", 2),
        DeviceSpec(
            VGA,
            nv,
            0x2230,
            0x030000,
            0xA1,
            nv,
            0x1459,
            "0000:00:02.0",
            0,
            11,
            gpu_driver,
            "a6000",
            consumers=(HDA,),
        ),
        DeviceSpec(HDA, nv, 0x1AEF, 0x040300, 0xA1, nv, 0x1459, "0000:00:02.0", 0, 11, hda_driver),
        bridge("0000:00:03.0", 3),
        DeviceSpec(
            NIC,
            0x15B3,
            0x101B,
            0x020000,
            0,
            0x15B3,
            0x0007,
            "0000:00:03.0",
            1,
            12,
            "mlx5_core",
            sriov_total_vfs=4,
            vf_offset=2,
            vf_device=0x101C,
        ),
        bridge("0000:00:04.0", 4),
        DeviceSpec(T4, nv, 0x1EB8, 0x030200, 0xA1, nv, 0x12A2, "0000:00:04.0", 1, 13, gpu_driver, "t4"),
        bridge("0000:00:05.0", 5),
        DeviceSpec(L40S, nv, 0x26B9, 0x030200, 0xA1, nv, 0x1851, "0000:00:05.0", 1, 14, gpu_driver, "l40s"),
    ]


def make_spec(flavour: str | None = "datacenter", **overrides: object) -> HostSpec:
    """``flavour``: which nvidia build is installed and loaded (None: none, GPUs unbound)."""
    modules = ["pci_pf_stub", "pci_stub", "snd_hda_intel", "mlx5_core", "vfio_pci"]
    if flavour == "datacenter":
        modules += ["nvidia", "nvidia_uvm", "nvidia_modeset"]
    elif flavour == "vgpu":
        modules += ["nvidia", "nvidia_vgpu_vfio"]
    spec = HostSpec(
        name="test",
        description="emulated-kernel test host",
        hostname="gpu-test-01",
        devices=devices("nvidia" if flavour else None),
        gpu_models=dict(MODELS),
        modules=modules,
    )
    for key, value in overrides.items():
        setattr(spec, key, value)
    return spec


def build(root: Path, spec: HostSpec, flavour: str | None = "datacenter") -> EmulatedKernel:
    files = nvidia_module_files(flavour, NV_VERSION) if flavour else []
    create_kernel_tree(spec, root, files)
    return EmulatedKernel(root)


@pytest.fixture
def dc(tmp_path: Path, host_templates: HostTemplates) -> EmulatedKernel:
    """Data-center driver loaded, every GPU bound to nvidia."""
    build_dc = partial(_build_into, flavour="datacenter")
    return EmulatedKernel(host_templates.copy("kernel-datacenter", build_dc, tmp_path / "host"))


@pytest.fixture
def vgpu(tmp_path: Path, host_templates: HostTemplates) -> EmulatedKernel:
    """vGPU manager loaded, every GPU bound to nvidia."""
    build_vgpu = partial(_build_into, flavour="vgpu")
    return EmulatedKernel(host_templates.copy("kernel-vgpu", build_vgpu, tmp_path / "host"))


def _build_into(root: Path, flavour: str) -> None:
    """The template of ``dc`` / ``vgpu``: built once per session, each test gets a copy of it."""
    build(root, make_spec(flavour), flavour)


def read(kernel: EmulatedKernel, relpath: str) -> str:
    return (kernel.root / relpath).read_text()


def dev(address: str, attr: str = "") -> str:
    return f"sys/bus/pci/devices/{address}" + (f"/{attr}" if attr else "")
