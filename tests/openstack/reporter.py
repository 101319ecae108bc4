"""The stand-in for nova-compute where a test needs it to misbehave on cue (not report, fail to restart); the
tests marked ``nova`` run the real one (``realnova.py``). Plays nova-compute after a restart: reads the
gpumode drop-in from the (emulated) host, looks at the host's devices, and reports to the REAL Placement over
HTTP what nova-compute's resource tracker would: the compute node provider, one ``<host>_pci_…`` child with
``VGPU`` inventory per configured mdev parent, one ``<host>_<address>`` child per ``device_spec`` device when
``report_in_placement`` is on, and it removes the children its configuration no longer names — except where
Placement refuses because of allocations (nova then logs and keeps the provider, as this does)."""

from __future__ import annotations

import json
from typing import Any

from gpumode.host.discover import discover
from gpumode.host.root import Host

from .services import PlacementAdmin


def parse_dropin(text: str) -> dict[str, dict[str, list[str]]]:
    """oslo.config's view of the file: sections → option → values (multi-valued options repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"option outside a section: {line}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


class NovaComputeReporter:
    def __init__(self, placement: PlacementAdmin, host: Host, dropin: str) -> None:
        self.placement = placement
        self.host = host
        self.dropin = dropin
        self.restarts = 0
        self.kept: list[str] = []  # providers nova could not remove (allocations)
        self.skipped: list[str] = []  # configured mdev parents the host did not offer the type on (logged)

    def restart(self) -> None:
        self.restarts += 1
        snap = discover(self.host)
        name = snap.hostname
        conf = parse_dropin(self.host.path(self.dropin).read_text())
        p = self.placement
        root = p.providers().get(name) or p.call("POST", "/resource_providers", {"name": name})
        self._inventory(root["uuid"], {"VCPU": 64, "MEMORY_MB": 262144})
        wanted: dict[str, tuple[str, int]] = {}
        for type_id in _split(conf.get("devices", {}).get("enabled_mdev_types", [""])[0]):
            for parent in _split(conf.get(f"mdev_{type_id}", {}).get("device_addresses", [""])[0]):
                # The configuration and the devices are read at different times, and a switch or its
                # rollback may be between them (the drop-in already restored, the GPU still on vfio-pci):
                # nova-compute then logs that the device does not offer the type and reports no VGPU for
                # it; the next restart, on a settled host, reports it.
                fn = snap.function(parent)
                types = {t.type_id: t.available_instances for t in fn.mdev_types} if fn is not None else {}
                if fn is None or type_id not in types:
                    self.skipped.append(f"{parent}: no mdev type {type_id}")
                    continue
                existing = sum(1 for m in fn.mdevs if m.type_id == type_id)
                free = types[type_id]
                wanted[f"{name}_pci_" + parent.replace(":", "_").replace(".", "_")] = (
                    "VGPU",
                    existing + free,
                )
        pci = conf.get("pci", {})
        if pci.get("report_in_placement", ["False"])[0] == "True":
            for spec in (json.loads(s) for s in pci.get("device_spec", [])):
                rc = spec["resource_class"]
                p.call("PUT", f"/resource_classes/{rc}", ok=(201, 204))
                wanted[f"{name}_{spec['address'].upper()}"] = (rc, 1)  # nova upper-cases the address
        children = {
            n: q for n, q in p.providers().items() if q["root_provider_uuid"] == root["uuid"] and n != name
        }
        for child, (rc, total) in wanted.items():
            rp = children.get(child) or p.call(
                "POST", "/resource_providers", {"name": child, "parent_provider_uuid": root["uuid"]}
            )
            self._inventory(rp["uuid"], {rc: total})
        for child, rp in children.items():
            if child in wanted:
                continue
            resp = p.http.delete(f"/resource_providers/{rp['uuid']}/inventories")
            if resp.status_code == 409:  # inventory in use: nova logs and keeps the provider
                self.kept.append(child)
                continue
            p.call("DELETE", f"/resource_providers/{rp['uuid']}")

    def _inventory(self, rp: str, totals: dict[str, int]) -> None:
        gen = self.placement.call("GET", f"/resource_providers/{rp}")["generation"]
        body: dict[str, Any] = {
            "resource_provider_generation": gen,
            "inventories": {rc: {"total": t, "max_unit": t} for rc, t in totals.items()},
        }
        self.placement.call("PUT", f"/resource_providers/{rp}/inventories", body)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.replace(",", " ").split() if t.strip()]
