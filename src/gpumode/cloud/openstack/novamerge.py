"""nova-compute's configuration as it reads it: gpumode's drop-in merged with the operator's files, and
whether the result gives the GPUs the modes a switch targets.

nova-compute reads ``/etc/nova/nova.conf`` and then every ``*.conf`` of ``/etc/nova/nova.conf.d`` in name
order (oslo.config's default config file and directory). oslo.config merges them per option: a single-valued
option is the last file's value, a multi-valued one (``MultiStrOpt``: ``[pci] device_spec``, ``[pci] alias``)
is every value of every file, in order. So the drop-in's ``[devices] enabled_mdev_types`` replaces the
operator's, but a drop-in without it (accel, passthrough) leaves the operator's in force; ``device_spec``
entries add up; and ``[pci] report_in_placement`` is one global switch. ``tests/openstack/test_novamerge.py``
checks these rules against nova's own parse (nova's option definitions, ``nova.pci.whitelist``,
``nova.pci.request``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumode.domain import HostSnapshot, Mode

MULTI = {("pci", "device_spec"), ("pci", "alias")}
# nova's deprecated option names, still read (nova/conf/pci.py, nova/conf/devices.py)
DEPRECATED = {
    ("pci", "passthrough_whitelist"): ("pci", "device_spec"),
    ("devices", "enabled_vgpu_types"): ("devices", "enabled_mdev_types"),
}
_TRUE, _FALSE = {"true", "1", "on", "yes"}, {"false", "0", "off", "no"}  # oslo.config's BoolOpt


class NovaConfigError(ValueError):
    """A file nova-compute would not read as gpumode needs it; the message names the file and option."""


@dataclass(frozen=True, slots=True)
class Value:
    value: str
    file: str


@dataclass(slots=True)
class MergedNovaConf:
    """The options gpumode's modes depend on, each with the file it came from."""

    single: dict[tuple[str, str], Value] = field(default_factory=dict)
    multi: dict[tuple[str, str], list[Value]] = field(default_factory=dict)

    def get(self, section: str, option: str) -> Value | None:
        return self.single.get((section, option))

    def enabled_mdev_types(self) -> tuple[list[str], str | None]:
        found = self.get("devices", "enabled_mdev_types")
        return (_list(found.value), found.file) if found else ([], None)

    def report_in_placement(self) -> tuple[bool, str | None]:
        found = self.get("pci", "report_in_placement")
        if found is None:
            return False, None
        word = found.value.lower()
        if word not in _TRUE | _FALSE:
            raise NovaConfigError(
                f"{found.file}: [pci] report_in_placement = {found.value!r} is not a boolean"
            )
        return word in _TRUE, found.file

    def device_specs(self) -> list[tuple[dict[str, Any], str]]:
        """Every ``[pci] device_spec`` entry (a value may hold one JSON object or a list of them)."""
        return [(spec, v.file) for v in self.multi.get(("pci", "device_spec"), []) for spec in _json(v)]


def parse_ini(text: str, name: str) -> dict[tuple[str, str], list[str]]:
    """One file as oslo.config's ini parser reads it: ``(section, option) → values`` (repeats kept, quotes
    around a value stripped, indented lines continuing the value above)."""
    options: dict[tuple[str, str], list[str]] = {}
    section: str | None = None
    last: tuple[str, str] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith(("#", ";")):
            continue
        if raw[0] in " \t" and last is not None:
            options[last][-1] = (options[last][-1] + "\n" + raw.strip()).strip()
            continue
        line = raw.strip()
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise NovaConfigError(f"{name} line {number}: bad section header {line!r}")
            section, last = line[1:-1], None
            continue
        key, sep, value = line.partition("=")
        if not sep:
            key, sep, value = line.partition(":")
        if not sep or not key.strip():
            raise NovaConfigError(f"{name} line {number}: expected 'option = value', got {line!r}")
        if section is None:
            raise NovaConfigError(f"{name} line {number}: option {key.strip()!r} before any section")
        value = value.strip()
        if len(value) > 1 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        last = DEPRECATED.get((section, key.strip()), (section, key.strip()))
        options.setdefault(last, []).append(value)
    return options


def merge(files: Sequence[tuple[str, str]]) -> MergedNovaConf:
    """``files``: ``(name, text)`` in nova-compute's reading order (see :func:`reading_order`)."""
    merged = MergedNovaConf()
    for name, text in files:
        for key, values in parse_ini(text, name).items():
            if key in MULTI:
                merged.multi.setdefault(key, []).extend(Value(v, name) for v in values)
            else:
                merged.single[key] = Value(values[-1], name)
    return merged


def reading_order(conf: str | None, conf_d: Sequence[str]) -> list[str]:
    """``nova.conf`` first, then the directory's ``*.conf`` files by name, as oslo.config reads them."""
    return ([conf] if conf else []) + sorted((p for p in conf_d if p.endswith(".conf")), key=_basename)


def problems(
    merged: MergedNovaConf, after: HostSnapshot, *, dropin: str, pci_in_placement: bool
) -> list[str]:
    """Why the merged configuration would not give the GPUs the modes ``after`` says (empty: it would). Each
    problem names the file and option at fault."""
    found: list[str] = []
    vgpu_types = {
        m.type_id
        for gpu in after.gpus
        if gpu.mode is Mode.VGPU
        for fn in after.functions
        for m in fn.mdevs
        if m.uuid in gpu.mdevs
    }
    types, where = merged.enabled_mdev_types()
    if set(types) != vgpu_types and where is not None and where != dropin:
        wanted = ", ".join(sorted(vgpu_types)) or "none"
        found.append(
            f"{where}: [devices] enabled_mdev_types = {', '.join(types)} stays in force after the switch "
            f"(gpumode's {dropin} sets {wanted}): nova-compute would offer vGPUs the GPUs do not have; "
            "remove it there"
        )
    for spec, file in merged.device_specs():
        if file == dropin:
            continue
        for gpu in after.gpus:
            if gpu.mode is not Mode.PASSTHROUGH and _claims(spec, after, gpu.address):
                found.append(
                    f"{file}: [pci] device_spec {json.dumps(spec, sort_keys=True)} claims GPU {gpu.address}, "
                    f"which is in {gpu.mode.value} mode after the switch (device_spec entries add up across "
                    "files): narrow it to the devices meant for passthrough"
                )
    report, where = merged.report_in_placement()
    if report != pci_in_placement:
        source = f"{where} sets it to {report}" if where else "no file sets it (nova's default is False)"
        found.append(
            f"[pci] report_in_placement: {source}, but gpumode's pci_in_placement is {pci_in_placement}: "
            "nova and gpumode would disagree on the GPUs' providers"
        )
    return found


def _claims(spec: dict[str, Any], snapshot: HostSnapshot, address: str) -> bool:
    """Does a device_spec match this PCI function? (vendor/product ids and the address, ``*`` wildcards.)"""
    fn = snapshot.function(address)
    if fn is None:
        return False
    for key, actual in (("vendor_id", f"{fn.vendor:04x}"), ("product_id", f"{fn.device:04x}")):
        wanted = str(spec.get(key, "*")).lower()
        if wanted not in ("*", "", actual):
            return False
    pattern = spec.get("address", "*")
    if isinstance(pattern, str) and pattern not in ("*", ""):
        return _address_matches(pattern.lower(), address)
    return not isinstance(pattern, dict)  # a dict (regex) address: not claimed unless gpumode can tell


def _address_matches(pattern: str, address: str) -> bool:
    """nova's glob form ``[[[domain]:]bus]:][slot][.[function]]``, each part a hex number or ``*``/empty."""
    parts = pattern.split(":")
    slot_fn = parts[-1]
    want_bus = parts[-2] if len(parts) >= 2 else "*"
    want_domain = parts[-3] if len(parts) >= 3 else "*"
    want_slot, _, want_fn = slot_fn.partition(".")
    domain, bus, dev_fn = address.split(":")
    slot, fn = dev_fn.split(".")
    pairs = ((want_domain, domain), (want_bus, bus), (want_slot, slot), (want_fn, fn))
    try:
        return all(w in ("", "*") or int(w, 16) == int(a, 16) for w, a in pairs)
    except ValueError:
        return True  # a form gpumode cannot read: nova may still match it; err on naming it


def _list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _json(value: Value) -> list[dict[str, Any]]:
    try:
        data = json.loads(value.value)
    except json.JSONDecodeError as exc:
        raise NovaConfigError(f"{value.file}: [pci] device_spec {value.value!r} is not JSON: {exc}") from exc
    specs = data if isinstance(data, list) else [data]
    if not all(isinstance(s, dict) for s in specs):
        raise NovaConfigError(f"{value.file}: [pci] device_spec {value.value!r} is not a JSON object or list")
    return specs


def _basename(path: str) -> str:
    return path.rsplit("/", 1)[-1]
