"""Synthetic host snapshots built from domain types (no emulated host needed)."""

from __future__ import annotations

from typing import Any

from gpumode.domain import (
    NVIDIA_VENDOR,
    DriverState,
    Flavour,
    Gpu,
    HostSnapshot,
    Mdev,
    Mode,
    NvidiaDriver,
    PciFunction,
    VendorVgpu,
)

H100 = 0x2330
L40S = 0x26B9


def gpu_function(
    address: str,
    *,
    device: int = H100,
    group: int = 10,
    subsys: int = 0x16C1,
    driver: str = "nvidia",
    mdevs: list[Mdev] | None = None,
) -> PciFunction:
    return PciFunction(
        address=address,
        vendor=NVIDIA_VENDOR,
        device=device,
        subsystem_vendor=NVIDIA_VENDOR,
        subsystem_device=subsys,
        class_code=0x030200,
        revision=0xA1,
        numa_node=0,
        iommu_group=group,
        driver=driver,
        device_name="GH100 [H100 SXM5 80GB]",
        mdevs=mdevs or [],
    )


def host(
    name: str,
    gpus: int = 2,
    *,
    mode: Mode = Mode.ACCEL,
    device: int = H100,
    changes: dict[str, dict[str, Any]] | None = None,
) -> HostSnapshot:
    """A host with ``gpus`` GPUs at 0000:1b+i:00.0 (IOMMU group 10+i); ``changes`` overrides per address."""
    functions: list[PciFunction] = []
    gpu_list: list[Gpu] = []
    driver = {Mode.ACCEL: "nvidia", Mode.VGPU: "nvidia", Mode.PASSTHROUGH: "vfio-pci", Mode.NONE: None}[mode]
    for i in range(gpus):
        address = f"0000:{0x1B + i:02x}:00.0"
        fn = gpu_function(address, device=device, group=10 + i, driver=driver or "nvidia")
        fn.driver = driver
        mdev_ids: list[str] = []
        if mode is Mode.VGPU:
            mdev_ids = [f"00000000-0000-0000-{i:04x}-{j:012x}" for j in range(2)]
            fn.mdevs = [Mdev(u, "nvidia-222", address) for u in mdev_ids]
        for key, value in (changes or {}).get(address, {}).items():
            setattr(fn, key, value)
        functions.append(fn)
        gpu_list.append(
            Gpu(
                address=address,
                device=fn.device,
                name="H100",
                numa_node=0,
                iommu_group=fn.iommu_group,
                driver=driver,
                mode=mode,
                mdevs=mdev_ids,
            )
        )
    state = {
        Mode.ACCEL: DriverState.DATACENTER,
        Mode.VGPU: DriverState.VGPU_HOST,
        Mode.PASSTHROUGH: DriverState.VFIO,
        Mode.NONE: DriverState.NONE,
    }[mode]
    flavour = Flavour.VGPU if mode is Mode.VGPU else Flavour.DATACENTER
    snap = HostSnapshot(
        hostname=name,
        kernel="6.8.0-45-generic",
        functions=functions,
        gpus=gpu_list,
        nvswitches=[],
        modules=[],
        nvidia=NvidiaDriver(loaded=mode is not Mode.PASSTHROUGH, flavour=flavour, version="550.90.07"),
        driver_state=state,
    )
    snap.fingerprint = snap.compute_fingerprint()
    return snap


def with_vendor_vgpu(
    snap: HostSnapshot, gpu_address: str, vf_address: str, type_id: int = 1147
) -> HostSnapshot:
    """Add a VF under ``gpu_address`` carrying a vendor vGPU type (vGPU 17+ style)."""
    vf = PciFunction(
        address=vf_address,
        vendor=NVIDIA_VENDOR,
        device=0x26B9,
        subsystem_vendor=NVIDIA_VENDOR,
        subsystem_device=0x1851,
        class_code=0x030200,
        revision=0xA1,
        iommu_group=200,
        driver="nvidia",
        physfn=gpu_address,
        vendor_vgpu=VendorVgpu({type_id: "NVIDIA L40S-1Q", 1148: "NVIDIA L40S-2Q"}, type_id),
    )
    snap.functions.append(vf)
    gpu = snap.gpu(gpu_address)
    assert gpu is not None
    gpu.vfs.append(vf_address)
    gpu.vgpus.append(vf_address)
    snap.fingerprint = snap.compute_fingerprint()
    return snap


def refingerprint(snap: HostSnapshot) -> HostSnapshot:
    snap.fingerprint = snap.compute_fingerprint()
    return snap
