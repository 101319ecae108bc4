"""An emulated host shaped like the guest: the functions the differential sequence touches, their bridges,
the same IDs, classes, IOMMU groups, drivers and SR-IOV layout, all as discovery read them in the guest."""

from __future__ import annotations

from typing import Any

from differential import WATCHED

from gpumode.emulated.spec import DeviceSpec, HostSpec

MODULES = ["bochs", "snd_hda_intel", "e1000e", "nvme", "vfio_pci"]


def twin_spec(discovery: dict[str, Any]) -> HostSpec:
    functions = {fn["address"]: fn for fn in discovery["snapshot"]["functions"]}
    parents: dict[str, str | None] = discovery["parents"]
    wanted: list[str] = []
    for address in WATCHED:
        chain = [address]
        while parents.get(chain[-1]):
            chain.append(str(parents[chain[-1]]))
        wanted += [a for a in reversed(chain) if a not in wanted]
    host_bridge = "0000:00:00.0"
    devices = []
    for address in [host_bridge, *wanted]:
        fn = functions[address]
        sriov = fn.get("sriov") or {}
        devices.append(
            DeviceSpec(
                address=address,
                vendor=fn["vendor"],
                device=fn["device"],
                class_code=fn["class_code"],
                revision=fn["revision"],
                subsystem_vendor=fn["subsystem_vendor"],
                subsystem_device=fn["subsystem_device"],
                parent=parents.get(address),
                iommu_group=fn["iommu_group"],
                driver=fn["driver"],
                sriov_total_vfs=sriov.get("total_vfs", 0),
                vf_offset=sriov.get("offset", 1),
                vf_stride=sriov.get("stride", 1),
            )
        )
    return HostSpec(
        name="kernel-guest-twin",
        description="the QEMU guest of tests/kernel, as an emulated host",
        hostname="twin",
        devices=devices,
        gpu_models={},
        kernel_release=discovery["snapshot"]["kernel"] or "6.1.0-amd64",
        modules=list(MODULES),
    )
