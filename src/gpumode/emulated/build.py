"""Lay out the kernel half of an emulated host from a :class:`HostSpec`.

:func:`create_kernel_tree` checks the whole spec first (a bad spec writes nothing), then boots the emulated
kernel into the spec's starting situation the way a real one would get there: in-tree module files, modules
loaded, devices bound as the spec says (devices whose spec driver is ``None`` stay unbound even if a driver
would match), overrides set, VFs enabled and probed, vGPUs created. The userspace half (packages, services,
VMs) is laid out by its own builder on top of this.
"""

from __future__ import annotations

import errno
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

from gpumode.domain import NVIDIA_VENDOR, PciAddress, PciAddressError
from gpumode.emulated import drivers, modules, nvidia, pci, sysfs
from gpumode.emulated import state as state_mod
from gpumode.emulated.kernel import load_modules, register_builtin_drivers
from gpumode.emulated.spec import DeviceSpec, HostSpec
from gpumode.emulated.state import Device, KernelState

FIRST_IRQ = 24


class SpecError(ValueError):
    """The host spec is inconsistent; the message names the field and value."""


def create_kernel_tree(
    spec: HostSpec, directory: Path, module_files: Sequence[modules.ModuleFile] = ()
) -> None:
    """Create the kernel-shaped tree of ``spec`` under ``directory`` (made if missing; must not be a host
    yet).

    ``module_files`` are extra ``.ko`` files present at boot besides the in-tree ones (the NVIDIA modules of
    the spec's installed packages, from :func:`gpumode.emulated.modules.nvidia_module_files`); the spec's
    ``modules`` may name them. Raises :class:`SpecError` (and writes nothing) when the spec is inconsistent.
    """
    directory = Path(directory)
    _validate(spec)
    if (directory / state_mod.MARKER / state_mod.STATE_FILE).exists():
        raise SpecError(f"{directory} already holds an emulated host")
    st = _initial_state(spec)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    modules.install_module_files(
        directory, [*modules.IN_TREE_MODULES, *module_files], release=spec.kernel_release
    )
    try:
        _boot(directory, spec, st)
    except OSError as exc:  # the module files were needed to boot; take them back so nothing is left behind
        shutil.rmtree(directory if created else modules.modules_dir(directory, spec.kernel_release))
        raise SpecError(f"host {spec.name!r}: the spec's starting state is impossible: {exc}") from exc
    (directory / state_mod.MARKER).mkdir(exist_ok=True)
    with state_mod.locked(directory):
        state_mod.save(directory, st)
        sysfs.apply(directory, sysfs.Tree(), sysfs.render(st))
    (directory / "etc").mkdir(exist_ok=True)
    (directory / "etc" / "hostname").write_text(spec.hostname + "\n")


def _validate(spec: HostSpec) -> None:
    seen: dict[str, DeviceSpec] = {}
    for dev in spec.devices:
        try:
            canonical = str(PciAddress.parse(dev.address))
        except PciAddressError as exc:
            raise SpecError(f"device {dev.address!r}: {exc}") from None
        if canonical != dev.address:
            raise SpecError(f"device {dev.address!r}: write addresses in canonical form ({canonical})")
        if dev.address in seen:
            raise SpecError(f"device {dev.address} listed twice")
        seen[dev.address] = dev
        if dev.gpu_model is not None and dev.gpu_model not in spec.gpu_models:
            raise SpecError(f"device {dev.address}: unknown gpu_model {dev.gpu_model!r}")
    for dev in spec.devices:
        if dev.parent is not None:
            parent = seen.get(dev.parent)
            if parent is None:
                raise SpecError(f"device {dev.address}: parent {dev.parent} is not in the spec")
            if parent.class_code >> 8 != 0x0604:
                raise SpecError(
                    f"device {dev.address}: parent {dev.parent} is not a PCI bridge (class 0604xx)"
                )
        for consumer in dev.consumers:
            if consumer not in seen:
                raise SpecError(f"device {dev.address}: consumer {consumer} is not in the spec")
    for pf, count in spec.sriov_numvfs.items():
        if pf not in seen:
            raise SpecError(f"sriov_numvfs: {pf} is not in the spec")
        total = _sriov_caps(spec, seen[pf])[0]
        if not 0 <= count <= total:
            raise SpecError(f"sriov_numvfs: {pf} asks for {count} VFs, it has {total}")
    for address in spec.driver_overrides:
        if address not in seen:
            raise SpecError(f"driver_overrides: {address} is not in the spec")


def _sriov_caps(spec: HostSpec, dev: DeviceSpec) -> tuple[int, int, int, int | None]:
    model = spec.gpu_models.get(dev.gpu_model) if dev.gpu_model else None
    if model is not None:
        return model.sriov_total_vfs, model.vf_offset, model.vf_stride, model.vf_device
    return dev.sriov_total_vfs, dev.vf_offset, dev.vf_stride, dev.vf_device


def _gpu_uuid(hostname: str, address: str) -> str:
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpumode:{hostname}:{address}"))


def _initial_state(spec: HostSpec) -> KernelState:
    devices: dict[str, Device] = {}
    for irq, dev in enumerate(spec.devices, start=FIRST_IRQ):
        total, offset, stride, vf_device = _sriov_caps(spec, dev)
        devices[dev.address] = Device(
            address=dev.address,
            vendor=dev.vendor,
            device=dev.device,
            class_code=dev.class_code,
            revision=dev.revision,
            subsystem_vendor=dev.subsystem_vendor,
            subsystem_device=dev.subsystem_device,
            parent=dev.parent,
            numa_node=dev.numa_node,
            iommu_group=dev.iommu_group if spec.iommu else None,
            gpu_model=dev.gpu_model,
            consumers=list(dev.consumers),
            pcie=dev.pcie,
            irq=irq,
            sriov_total_vfs=total,
            sriov_offset=offset,
            sriov_stride=stride,
            sriov_vf_device=vf_device or 0,
            gpu_uuid=_gpu_uuid(spec.hostname, dev.address) if dev.vendor == NVIDIA_VENDOR else "",
        )
    iommu_args = " intel_iommu=on iommu=pt" if spec.iommu else ""
    return KernelState(
        hostname=spec.hostname,
        kernel_release=spec.kernel_release,
        iommu=spec.iommu,
        models=dict(spec.gpu_models),
        devices=devices,
        cmdline=f"BOOT_IMAGE=/boot/vmlinuz-{spec.kernel_release} root=/dev/mapper/vg0-root ro{iommu_args}",
    )


def _boot(root: Path, spec: HostSpec, st: KernelState) -> None:
    """Reach the spec's state: drivers registered without autoprobe, then bound exactly as the spec says."""
    st.bus_autoprobe = False
    register_builtin_drivers(st)
    for name in spec.modules:
        load_modules(root, st, name)
    for address, override in spec.driver_overrides.items():
        st.devices[address].driver_override = override or None
    for dev in spec.devices:
        if dev.driver is None:
            continue
        drv = st.drivers.get(dev.driver)
        if drv is None:
            raise OSError(
                errno.ENODEV,
                f"device {dev.address}: driver {dev.driver!r} is neither built in nor "
                "registered by a module in the spec's modules",
            )
        drivers.probe(st, drv, st.devices[dev.address])
    st.bus_autoprobe = True
    for pf, count in spec.sriov_numvfs.items():
        if count:
            pci.enable_vfs(st, st.devices[pf], count)
    for parent, type_id, mdev_uuid in spec.mdevs:
        parent_dev = st.present(parent)
        if parent_dev is None or not nvidia.is_mdev_parent(st, parent_dev):
            raise OSError(errno.ENODEV, f"mdev {mdev_uuid}: {parent} is not an mdev parent")
        nvidia.create_mdev(st, parent_dev, type_id, mdev_uuid)
    for vf_address, type_id in spec.vendor_vgpus.items():
        vf = st.present(vf_address)
        if vf is None or not nvidia.is_vendor_vf(st, vf):
            raise OSError(
                errno.ENODEV, f"vendor_vgpus: {vf_address} is not a VF with the nvidia/ vGPU interface"
            )
        nvidia.write_current_vgpu_type(st, vf, str(type_id))
