"""The nova-compute drop-in for a host's GPU modes (``/etc/nova/nova.conf.d/gpumode.conf``).

Rendered from the snapshot for every GPU of the host at once, so a host with vGPU and passthrough GPUs gets
both sections and an accelerator-only host gets an empty (but present) file that overrides an older one — with
``[pci] report_in_placement = True`` whenever PCI-in-Placement is on, since nova cannot turn it off again.
Passthrough ``device_spec`` entries name each GPU's address: a model-wide spec would also claim the same
model's GPUs that stay in ``accel`` or ``vgpu`` mode on this host.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from gpumode.cloud.openstack.expect import mdev_parents, pci_resource_class
from gpumode.domain import HostSnapshot, Mode

HEADER = "# Written by gpumode for the GPUs' current modes; edits are overwritten at the next switch.\n"


class RenderError(ValueError):
    """The host is in a state nova cannot be configured for; the message names the GPU."""


def default_alias(vendor: int, device: int) -> str:
    return f"gpumode-{vendor:04x}-{device:04x}"


def render_dropin(
    snapshot: HostSnapshot,
    *,
    aliases: Mapping[tuple[int, int], str] | None = None,
    pci_in_placement: bool = False,
) -> str:
    """The drop-in text. ``aliases`` names the ``[pci] alias`` per (vendor, product); others get a default."""
    aliases = aliases or {}
    by_type: dict[str, list[str]] = {}
    specs: list[dict[str, str]] = []
    alias_entries: dict[str, dict[str, str]] = {}
    for gpu in sorted(snapshot.gpus, key=lambda g: g.address):
        if gpu.mode is Mode.VGPU:
            if gpu.vgpus and not gpu.mdevs:
                raise RenderError(
                    f"GPU {gpu.address} serves vGPUs through the vendor VFIO interface "
                    "(nvidia/current_vgpu_type); nova's libvirt driver configures mdev types only"
                )
            for parent, type_id in mdev_parents(snapshot, gpu.address).items():
                by_type.setdefault(type_id, []).append(parent)
        elif gpu.mode is Mode.PASSTHROUGH:
            fn = snapshot.function(gpu.address)
            vendor = fn.vendor if fn is not None else 0x10DE
            vendor_id, product_id = f"{vendor:04x}", f"{gpu.device:04x}"
            spec = {"vendor_id": vendor_id, "product_id": product_id, "address": gpu.address}
            if pci_in_placement:
                spec["resource_class"] = pci_resource_class(vendor, gpu.device)
            specs.append(spec)
            name = aliases.get((vendor, gpu.device)) or default_alias(vendor, gpu.device)
            alias_entries[name] = {
                "name": name,
                "vendor_id": vendor_id,
                "product_id": product_id,
                "device_type": "type-PCI",
            }
    lines = [HEADER]
    if by_type:
        lines += ["[devices]", f"enabled_mdev_types = {', '.join(sorted(by_type))}", ""]
        for type_id in sorted(by_type):
            lines += [f"[mdev_{type_id}]", f"device_addresses = {','.join(sorted(by_type[type_id]))}", ""]
    if specs or pci_in_placement:
        lines.append("[pci]")
        lines += [f"device_spec = {json.dumps(s, separators=(',', ':'))}" for s in specs]
        lines += [f"alias = {json.dumps(a, separators=(',', ':'))}" for _, a in sorted(alias_entries.items())]
        if pci_in_placement:
            # in every drop-in, whatever the modes: nova-compute refuses to start once it reported PCI devices
            # and report_in_placement is off (pci_placement_translator.ensure_tracking_was_not_enabled_before)
            lines.append("report_in_placement = True")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"
