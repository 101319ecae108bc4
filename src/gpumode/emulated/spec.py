"""Declarative description of an emulated host: the hardware, and the state it starts in.

A fixture (``fixtures/*.py``) returns a :class:`HostSpec`; :func:`gpumode.emulated.build.create_host`
lays it out as a kernel-shaped tree under a directory. The spec says *what* exists; the emulated kernel
decides *how* it looks in sysfs (formats, links, side effects), exactly as a real kernel would from the same
hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# mdev_supported_types (pre-Ada) | <VF>/nvidia/current_vgpu_type (vGPU 17+)
VgpuInterface = Literal["mdev", "vendor"]


@dataclass(frozen=True, slots=True)
class VgpuTypeSpec:
    """A vGPU type a GPU model offers under the vGPU manager."""

    type_id: int  # NVML type id: mdev type dir is f"nvidia-{type_id}", vendor interface uses the number
    name: str  # "GRID T4-1Q", "NVIDIA L40S-4Q"
    framebuffer_mib: int
    max_instances: int  # per physical GPU
    heads: int = 1
    max_resolution: str = "5120x2880"
    frl_config: int = 60


@dataclass(frozen=True, slots=True)
class GpuModelSpec:
    """Hardware facts of one NVIDIA GPU model."""

    key: str  # "h100-sxm5"
    device: int  # PCI device id
    subsystem_device: int
    class_code: int  # 0x030200 (3D) or 0x030000 (VGA)
    revision: int = 0xA1
    sriov_total_vfs: int = 0  # 0: no SR-IOV capability
    vf_offset: int = 4
    vf_stride: int = 1
    vf_device: int | None = None  # device id of the VFs (defaults to the PF's)
    vgpu_interface: VgpuInterface | None = None  # None: no vGPU support
    vgpu_types: tuple[VgpuTypeSpec, ...] = ()
    bar0_mib: int = 16
    # where vGPUs live; None: on the VFs when the model has SR-IOV, else on the PF. A T4 has an SR-IOV
    # capability (16 VFs) yet its vGPUs are mdevs on the PF.
    vgpu_parent: Literal["pf", "vf"] | None = None

    @property
    def vgpus_on_vfs(self) -> bool:
        if self.vgpu_parent is not None:
            return self.vgpu_parent == "vf"
        return bool(self.sriov_total_vfs)


@dataclass(slots=True)
class DeviceSpec:
    """One PCI function present at boot. VFs are not listed: the kernel creates them on ``sriov_numvfs``."""

    address: str
    vendor: int
    device: int
    class_code: int
    revision: int = 0
    subsystem_vendor: int = 0
    subsystem_device: int = 0
    parent: str | None = None  # upstream bridge; None: on the root bus
    numa_node: int = -1
    iommu_group: int | None = None  # None: no iommu_group link (no IOMMU)
    driver: str | None = None  # bound at start; the driver must exist (built in or a loaded module's)
    gpu_model: str | None = None  # key of a GpuModelSpec, for NVIDIA GPUs
    consumers: tuple[str, ...] = ()  # consumer:pci: device links (VGA function -> its HDA function)
    pcie: bool = True
    # SR-IOV capability of a non-GPU function (a NIC); GPUs take theirs from their GpuModelSpec
    sriov_total_vfs: int = 0
    vf_offset: int = 1
    vf_stride: int = 1
    vf_device: int | None = None


@dataclass(slots=True)
class VmSpec:
    """A VM of the emulated hypervisor at start."""

    name: str
    running: bool = True
    hostdevs: tuple[str, ...] = ()  # PCI addresses (passthrough GPUs or VFs with a vendor vGPU)
    mdevs: tuple[str, ...] = ()  # mdev uuids


@dataclass(slots=True)
class HostSpec:
    """A whole emulated host."""

    name: str
    description: str
    hostname: str
    devices: list[DeviceSpec]
    gpu_models: dict[str, GpuModelSpec]
    kernel_release: str = "6.8.0-45-generic"
    iommu: bool = True
    # the driver situation at start
    packages: list[str] = field(default_factory=list)  # installed package names (see userspace catalogue)
    modules: list[str] = field(default_factory=list)  # loaded modules (dependencies are loaded too)
    services: list[str] = field(default_factory=list)  # running systemd units
    sriov_numvfs: dict[str, int] = field(default_factory=dict)  # PF address -> VFs enabled at start
    driver_overrides: dict[str, str] = field(default_factory=dict)  # address -> driver_override at start
    mdevs: list[tuple[str, int, str]] = field(default_factory=list)  # (parent address, vGPU type id, uuid)
    vendor_vgpus: dict[str, int] = field(default_factory=dict)  # VF address -> current_vgpu_type
    vms: list[VmSpec] = field(default_factory=list)
