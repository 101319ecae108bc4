"""What Placement should show for a host in a given state: pure, from the host's snapshot alone.

nova-compute names its providers after the hypervisor hostname: one child per mdev parent
(``<host>_pci_0000_84_00_0``, the libvirt node device name; inventory ``VGPU``) and, with ``[pci]
report_in_placement``, one child per passthrough device (``<host>_0000:84:00.0`` with the address upper-cased,
as nova's ``pci_placement_translator`` names it: ``<host>_0000:3B:00.0``; inventory
``CUSTOM_PCI_<VENDOR>_<PRODUCT>``). Accelerator GPUs and passthrough GPUs not reported in Placement have no
provider: their marks go on the compute node's root provider.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumode.domain import HostSnapshot, Mode

TRAIT_PREFIX = "CUSTOM_GPUMODE_"
MODE_TRAITS = {m: f"{TRAIT_PREFIX}{m.value.upper()}" for m in (Mode.ACCEL, Mode.VGPU, Mode.PASSTHROUGH)}


def mode_trait(mode: Mode) -> str:
    return MODE_TRAITS[mode]


def mdev_provider_name(host: str, parent: str) -> str:
    """nova's name for an mdev parent's provider: the libvirt nodedev name under the hypervisor's."""
    return f"{host}_pci_" + parent.replace(":", "_").replace(".", "_")


def pci_provider_name(host: str, address: str) -> str:
    """nova's name for a PCI device's provider (``_get_rp_name_for_address``: the address upper-cased)."""
    return f"{host}_{address.upper()}"


def provider_gpu(snapshot: HostSnapshot, name: str) -> tuple[str, Mode] | None:
    """Which of the host's GPUs a provider nova named is for, and as what: ``(gpu address, VGPU)`` for an mdev
    parent (the GPU or one of its VFs), ``(gpu address, PASSTHROUGH)`` for a PCI device. None for every other
    provider, an operator's non-GPU PCI devices included: gpumode touches only GPUs it knows."""
    host = snapshot.hostname
    rest = name[len(host) + 1 :] if name.startswith(host + "_") else ""
    if rest.startswith("pci_"):
        for fn in snapshot.functions:
            if mdev_provider_name(host, fn.address) == name:
                gpu = snapshot.gpu(fn.physfn or fn.address)
                return (gpu.address, Mode.VGPU) if gpu is not None else None
        return None
    for gpu in snapshot.gpus:
        if pci_provider_name(host, gpu.address) == name:
            return gpu.address, Mode.PASSTHROUGH
    return None


def gpu_resource_class(snapshot: HostSnapshot, address: str) -> str:
    """The resource class gpumode's drop-in gives a passthrough GPU (``CUSTOM_PCI_<VENDOR>_<PRODUCT>``)."""
    fn = snapshot.function(address)
    gpu = snapshot.gpu(address)
    vendor = fn.vendor if fn is not None else 0x10DE
    device = gpu.device if gpu is not None else (fn.device if fn is not None else 0)
    return pci_resource_class(vendor, device)


def pci_resource_class(vendor: int, device: int) -> str:
    return f"CUSTOM_PCI_{vendor:04X}_{device:04X}"


@dataclass(frozen=True, slots=True)
class ExpectedProvider:
    """A child provider nova-compute must report for ``gpu``: ``min_total`` or more ``resource_class``."""

    name: str
    gpu: str
    mode: Mode
    resource_class: str
    min_total: int


@dataclass(frozen=True, slots=True)
class Expectation:
    """The host's GPU providers and the modes its root provider carries marks for."""

    host: str
    providers: tuple[ExpectedProvider, ...]
    root_modes: frozenset[Mode]

    def provider(self, name: str) -> ExpectedProvider | None:
        return next((p for p in self.providers if p.name == name), None)


def mdev_parents(snapshot: HostSnapshot, gpu_address: str) -> dict[str, str]:
    """Each mdev parent of a GPU (the GPU itself, or its VFs) → the mdev type its devices use."""
    gpu = snapshot.gpu(gpu_address)
    if gpu is None:
        return {}
    owned = set(gpu.mdevs)
    parents: dict[str, str] = {}
    for fn in snapshot.functions:
        for mdev in fn.mdevs:
            if mdev.uuid in owned:
                parents.setdefault(mdev.parent, mdev.type_id)
    return parents


def expectation(snapshot: HostSnapshot, *, pci_in_placement: bool) -> Expectation:
    host = snapshot.hostname
    providers: list[ExpectedProvider] = []
    modes: set[Mode] = set()
    for gpu in sorted(snapshot.gpus, key=lambda g: g.address):
        if gpu.mode not in MODE_TRAITS:
            continue
        modes.add(gpu.mode)
        if gpu.mode is Mode.VGPU:
            parents = mdev_parents(snapshot, gpu.address)
            for parent in sorted(parents):
                count = sum(1 for fn in snapshot.functions for m in fn.mdevs if m.parent == parent)
                providers.append(
                    ExpectedProvider(mdev_provider_name(host, parent), gpu.address, Mode.VGPU, "VGPU", count)
                )
        elif gpu.mode is Mode.PASSTHROUGH and pci_in_placement:
            fn = snapshot.function(gpu.address)
            vendor = fn.vendor if fn is not None else 0x10DE
            providers.append(
                ExpectedProvider(
                    pci_provider_name(host, gpu.address),
                    gpu.address,
                    Mode.PASSTHROUGH,
                    pci_resource_class(vendor, gpu.device),
                    1,
                )
            )
    return Expectation(host, tuple(providers), frozenset(modes))
