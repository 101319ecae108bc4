"""Which modes a request may name, and whether the host can hold the result.

Two kinds of rule, both checked before any plan is made:

- the whitelist (the "reference modes"): enabled platform-wide, narrowed per host group and per GPU model,
  plus the licences the platform holds. A mode may only be requested where all levels enable it. It is
  operator configuration (YAML, schema in ``docs/catalog.md``); :data:`DEFAULT_WHITELIST` applies otherwise.
- compatibility: what the hardware and drivers allow. The data-center driver and the vGPU manager are two
  builds of the same ``nvidia`` module, so a host may mix accel+passthrough or vgpu+passthrough, never
  accel+vgpu; passthrough needs an IOMMU group; vgpu needs vGPU types for the model (from the host once the
  vGPU manager is loaded, else from the catalog).

Every refusal is a :class:`RequestError` with a stable ``code`` (the table in :mod:`gpumode.errors`), a
message naming what was wrong, and the valid choices. :func:`parse_request` is the one check of a request's
own fields, for the local CLI, the REST API and the dashboard alike; :func:`resolve_request` then checks it
against the host.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpumode.domain import (
    Flavour,
    Gpu,
    HostSnapshot,
    Mode,
    PciAddressError,
    SwitchRequest,
    VmPolicy,
    normalize_address,
)
from gpumode.errors import GpumodeError
from gpumode.modes.catalog import Catalog, GpuModel, VgpuInterface, VgpuType, driver_branch
from gpumode.yamlfile import Node, read_yaml

WHITELIST_VERSION = "v1"
REQUESTABLE = (Mode.ACCEL, Mode.VGPU, Mode.PASSTHROUGH)
HOST_DRIVER_MODES = frozenset({Mode.ACCEL, Mode.VGPU})  # the two that need (different builds of) nvidia


class RequestError(GpumodeError, ValueError):
    """A switch request cannot be planned. ``code`` is stable (API, tests); ``choices`` lists what works."""

    def __init__(self, code: str, message: str, choices: Sequence[str] = ()) -> None:
        super().__init__(message, code=code, choices=choices)


def parse_mode(text: str | None) -> Mode:
    """A requestable mode from its name; ``missing_mode`` or ``unknown_mode`` otherwise."""
    choices = [m.value for m in REQUESTABLE]
    if text is None or not text.strip():
        raise RequestError("missing_mode", "a target mode is required", choices)
    value = text.strip().lower()
    for mode in REQUESTABLE:
        if mode.value == value:
            return mode
    raise RequestError("unknown_mode", f"unknown mode {text!r}", choices)


def parse_vm_policy(text: str | None) -> VmPolicy:
    if text is None:
        return VmPolicy.GPU
    try:
        return VmPolicy(text.strip().lower())
    except ValueError:
        raise RequestError(
            "unknown_vm_policy", f"unknown VM policy {text!r}", [p.value for p in VmPolicy]
        ) from None


def parse_address(text: str) -> str:
    """A GPU's canonical PCI address; ``bad_address`` when ``text`` is not one."""
    try:
        return normalize_address(text)
    except PciAddressError as exc:
        raise RequestError("bad_address", str(exc)) from None


def parse_request(
    *,
    mode: str | None,
    gpus: Sequence[str] = (),
    vgpu_type: str | None = None,
    vgpu_count: int | None = None,
    passthrough_alias: str | None = None,
    vm_policy: str | None = None,
    restart_vms: bool = True,
    allow_boot_vga: bool = False,
) -> SwitchRequest:
    """A switch request from its fields as a person gave them (CLI options, an API body, a form), checked on
    their own: the mode, the VM policy, each address, and which options go with which mode. What needs the
    host (does the GPU exist, is the type offered, may the mode run there) is :func:`resolve_request`'s."""
    request = SwitchRequest(
        mode=parse_mode(mode),
        gpus=[parse_address(g) for g in gpus],
        vgpu_type=vgpu_type,
        vgpu_count=vgpu_count,
        passthrough_alias=passthrough_alias,
        vm_policy=parse_vm_policy(vm_policy),
        restart_vms=restart_vms,
        allow_boot_vga=allow_boot_vga,
    )
    check_options(request)
    return request


# --- the whitelist ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HostGroup:
    name: str
    hosts: tuple[str, ...]  # fnmatch patterns on the hostname
    modes: frozenset[Mode]


@dataclass(frozen=True, slots=True)
class Whitelist:
    source: str
    platform: frozenset[Mode]
    groups: tuple[HostGroup, ...] = ()
    models: Mapping[int, frozenset[Mode]] = field(default_factory=dict)  # PCI device id -> modes
    vgpu_licensed: bool = True

    def group(self, hostname: str, name: str | None = None) -> HostGroup | None:
        """The host's group: the one named, else the first whose patterns match the hostname, else none."""
        if name is not None:
            for g in self.groups:
                if g.name == name:
                    return g
            raise RequestError(
                "unknown_host_group",
                f"no host group {name!r} in {self.source}",
                [g.name for g in self.groups],
            )
        for g in self.groups:
            if any(fnmatch.fnmatchcase(hostname, p) for p in g.hosts):
                return g
        return None


DEFAULT_WHITELIST: dict[str, Any] = {
    "version": "v1",
    # Set to false when the platform holds no NVIDIA vGPU software licence: vgpu is then refused everywhere.
    "licenses": {"vgpu": True},
    "platform": {"modes": ["accel", "vgpu", "passthrough"]},
    "host_groups": [],
    "gpu_models": {},
}


def load_whitelist(path: str | Path | None = None) -> Whitelist:
    """Load and validate a whitelist file; ``None`` gives :data:`DEFAULT_WHITELIST`."""
    if path is None:
        return parse_whitelist(DEFAULT_WHITELIST, "default whitelist")
    source, data = read_yaml(path, "")
    return parse_whitelist(data, source)


def parse_whitelist(data: Any, source: str = "<whitelist>") -> Whitelist:
    top = Node(source, "", data).mapping(
        required=("version", "platform"), optional=("licenses", "host_groups", "gpu_models")
    )
    if top["version"].value != WHITELIST_VERSION:
        raise top["version"].error(
            f"unsupported whitelist version {top['version'].value!r} (this gpumode reads v1)"
        )
    platform = _modes(top["platform"].mapping(required=("modes",))["modes"])
    licensed = True
    if "licenses" in top:
        licensed = top["licenses"].mapping(required=("vgpu",))["vgpu"].flag()
    groups: list[HostGroup] = []
    for node in top["host_groups"].items() if "host_groups" in top else []:
        m = node.mapping(required=("name", "modes"), optional=("hosts",))
        name = m["name"].text()
        if any(g.name == name for g in groups):
            raise m["name"].error(f"duplicate host group {name!r}")
        groups.append(HostGroup(name, m["hosts"].str_list() if "hosts" in m else (), _modes(m["modes"])))
    models: dict[int, frozenset[Mode]] = {}
    for key, node in top["gpu_models"].entries() if "gpu_models" in top else []:
        if len(key) != 4 or any(c not in "0123456789abcdef" for c in key):
            raise node.error(
                "GPU model keys are PCI device ids: 4 lowercase hex digits, quoted (e.g. '1eb8')"
            )
        models[int(key, 16)] = _modes(node.mapping(required=("modes",))["modes"])
    return Whitelist(source, platform, tuple(groups), models, licensed)


def _modes(node: Node) -> frozenset[Mode]:
    out = set()
    for item in node.items():
        out.add(Mode(item.choice(tuple(m.value for m in REQUESTABLE))))
    return frozenset(out)


# --- vGPU offers --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VgpuOffer:
    """The vGPU types one GPU can be carved into, and where its vGPUs live."""

    interface: VgpuInterface
    parent: Literal["pf", "vf"]  # mdev parent / vendor vGPU: the PF itself, or its VFs
    types: tuple[VgpuType, ...]
    num_vfs: int  # VFs available as parents (0 for "pf")
    source: Literal["host", "catalog"]

    def find(self, text: str) -> VgpuType | None:
        """A type by full name, name without its "NVIDIA "/"GRID " prefix, ``nvidia-<id>`` or ``<id>``."""
        wanted = text.strip().lower()
        for t in self.types:
            name = t.name.lower()
            short = name.split(" ", 1)[1] if name.startswith(("nvidia ", "grid ")) else name
            if wanted in (name, short, t.mdev_type, str(t.id)):
                return t
        return None


def vgpu_offer(snapshot: HostSnapshot, gpu: Gpu, catalog: Catalog) -> VgpuOffer | None:
    """What vGPUs ``gpu`` offers: the host's sysfs when the vGPU manager shows types, else the catalog's
    entry for the board (by device and subsystem ids) with the interface predicted for the vGPU manager's
    branch and the host's kernel."""
    pf = snapshot.function(gpu.address)
    model = model_of(snapshot, gpu, catalog)
    known = {t.id: t for t in model.vgpu_types} if model else {}
    vfs = [f for f in (snapshot.function(a) for a in gpu.vfs) if f is not None]
    total_vfs = (
        pf.sriov.total_vfs if pf is not None and pf.sriov is not None else (model.sriov_vfs if model else 0)
    )

    def from_host(entries: dict[int, tuple[str, int]], *, add_catalog: bool = False) -> tuple[VgpuType, ...]:
        # id -> (name, capacity seen on the host); the catalog's per-GPU maximum wins where it knows the type
        merged = {
            i: known[i] if i in known else VgpuType(i, name, 0, max(cap, 1))
            for i, (name, cap) in entries.items()
        }
        if add_catalog:
            for i, t in known.items():
                merged.setdefault(i, t)
        return tuple(merged[i] for i in sorted(merged))

    if pf is not None and pf.mdev_types:
        held = [m.type_id for m in pf.mdevs]
        entries = {
            int(t.type_id.rsplit("-", 1)[1]): (t.name, t.available_instances + held.count(t.type_id))
            for t in pf.mdev_types
            if t.type_id.rsplit("-", 1)[-1].isdigit()
        }
        return VgpuOffer("mdev", "pf", from_host(entries), 0, "host")
    vendor = [f.vendor_vgpu for f in vfs if f.vendor_vgpu is not None]
    if vendor:
        entries = {i: (n, len(vfs)) for v in vendor for i, n in v.creatable.items()}
        # creatable_vgpu_types lists only what fits beside the vGPUs now there; a re-layout removes them
        return VgpuOffer("vendor", "vf", from_host(entries, add_catalog=True), len(vfs), "host")
    vf_types = [t for f in vfs for t in f.mdev_types]
    if vf_types:
        entries = {
            int(t.type_id.rsplit("-", 1)[1]): (t.name, len(vfs))
            for t in vf_types
            if t.type_id.rsplit("-", 1)[-1].isdigit()
        }
        return VgpuOffer("mdev", "vf", from_host(entries), len(vfs), "host")
    if model is None:
        return None
    predicted = catalog.predicted_interface(model, vgpu_branch(snapshot, catalog), snapshot.kernel)
    if predicted is None:
        return None
    interface, parent = predicted
    num_vfs = (total_vfs or model.sriov_vfs) if parent == "vf" else 0
    return VgpuOffer(interface, parent, model.vgpu_types, num_vfs, "catalog")


def model_of(snapshot: HostSnapshot, gpu: Gpu, catalog: Catalog) -> GpuModel | None:
    """The catalog's entry for the board ``gpu`` is, by vendor, device and subsystem ids."""
    pf = snapshot.function(gpu.address)
    if pf is None:
        return catalog.model(gpu.device)
    return catalog.model(pf.device, (pf.subsystem_vendor, pf.subsystem_device), pf.vendor)


def vgpu_branch(snapshot: HostSnapshot, catalog: Catalog) -> int | None:
    """The vGPU manager branch the GPUs will run: the loaded one, else the one the catalog installs."""
    if snapshot.nvidia.flavour is Flavour.VGPU and snapshot.nvidia.version:
        return driver_branch(snapshot.nvidia.version)
    return driver_branch(catalog.flavour(Flavour.VGPU).version)


# --- request validation -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VgpuChoice:
    """The vGPU layout one GPU is asked for, resolved against what it offers."""

    offer: VgpuOffer
    type: VgpuType
    count: int


@dataclass(slots=True)
class Resolved:
    """A validated request: the GPUs it covers (in host order) and every GPU's mode afterwards."""

    request: SwitchRequest
    gpus: list[Gpu]
    after: dict[str, Mode]  # every GPU of the host -> its mode once the plan ran
    vgpu: dict[str, VgpuChoice] = field(default_factory=dict)  # requested GPU -> layout (mode vgpu only)
    group: HostGroup | None = None


def allowed_modes(
    snapshot: HostSnapshot, gpu: Gpu, catalog: Catalog, whitelist: Whitelist, group: HostGroup | None
) -> dict[Mode, str | None]:
    """For each requestable mode, ``None`` when ``gpu`` may be switched to it, else the reason it may not."""
    out: dict[Mode, str | None] = {}
    model_rule = whitelist.models.get(gpu.device)
    for mode in REQUESTABLE:
        reason: str | None = None
        if mode not in whitelist.platform:
            reason = f"disabled platform-wide ({whitelist.source})"
        elif group is not None and mode not in group.modes:
            reason = f"disabled for host group {group.name!r}"
        elif model_rule is not None and mode not in model_rule:
            reason = f"disabled for GPU model 10de:{gpu.device:04x}"
        elif mode is Mode.VGPU and not whitelist.vgpu_licensed:
            reason = "the platform holds no vGPU licence (licenses.vgpu is false)"
        elif mode is Mode.VGPU and vgpu_offer(snapshot, gpu, catalog) is None:
            reason = f"10de:{gpu.device:04x} offers no vGPU types (not in the catalog, none on the host)"
        elif mode is Mode.PASSTHROUGH and gpu.iommu_group is None:
            reason = "it has no IOMMU group (enable the IOMMU: intel_iommu=on / amd_iommu=on)"
        out[mode] = reason
    return out


def resolve_request(
    snapshot: HostSnapshot,
    request: SwitchRequest,
    catalog: Catalog,
    whitelist: Whitelist,
    *,
    host_group: str | None = None,
) -> Resolved:
    """Check a request against the host, the whitelist and compatibility.

    Returns the resolved request, or raises :class:`RequestError` naming the first thing wrong.
    """
    group = whitelist.group(snapshot.hostname, host_group)
    if request.mode not in REQUESTABLE:
        raise RequestError(
            "mode_not_allowed",
            f"mode {request.mode.value!r} cannot be requested: it is what a GPU with no driver shows",
            [m.value for m in REQUESTABLE],
        )
    gpus = _requested_gpus(snapshot, request)
    check_options(request)
    check_hardware(snapshot, gpus)
    for gpu in gpus:
        allowed = allowed_modes(snapshot, gpu, catalog, whitelist, group)
        reason = allowed[request.mode]
        if reason is not None:
            raise RequestError(
                "mode_not_allowed",
                f"mode {request.mode.value!r} is not allowed for GPU {gpu.address} ({gpu.name}): {reason}",
                [m.value for m, r in allowed.items() if r is None],
            )
    if request.mode is Mode.PASSTHROUGH and not request.allow_boot_vga:
        consoles = [g.address for g in gpus if boot_display(snapshot, g) and g.mode is not Mode.PASSTHROUGH]
        if consoles:
            raise RequestError(
                "boot_vga",
                f"GPU(s) {', '.join(consoles)} drive the boot console (boot_vga = 1): passthrough takes them "
                "from the host and the console goes dark; pass --allow-boot-vga (allow_boot_vga) to do it",
            )
    after = {g.address: g.mode for g in snapshot.gpus}
    for gpu in gpus:
        after[gpu.address] = request.mode
    check_compatible(snapshot, after, {g.address for g in gpus})
    resolved = Resolved(request, gpus, after, group=group)
    if request.mode is Mode.VGPU:
        for gpu in gpus:
            resolved.vgpu[gpu.address] = _vgpu_choice(snapshot, gpu, request, catalog)
    return resolved


PCI_DEVICES = "sys/bus/pci/devices"


def boot_display(snapshot: HostSnapshot, gpu: Gpu) -> bool:
    """The GPU is the firmware's boot display (its ``boot_vga`` reads 1): the host console is on it."""
    fn = snapshot.function(gpu.address)
    return fn is not None and fn.boot_vga is True


def check_hardware(snapshot: HostSnapshot, gpus: Sequence[Gpu]) -> None:
    """Refuse to plan on a host whose state could not be told, or on hardware that is not all there: a step
    would otherwise fail halfway (or act on the wrong device) at apply time."""
    unknown = [g.address for g in snapshot.gpus if g.mode is Mode.UNKNOWN]
    if unknown:
        raise RequestError(
            "host_state_unknown",
            f"GPU(s) {', '.join(unknown)} of host {snapshot.hostname} are in mode unknown: which nvidia "
            "build runs could not be told (see the problems `gpumode discover` lists); nothing is planned "
            "until the host's modules and vGPU state agree",
        )
    for gpu in gpus:
        for address in [gpu.address, *gpu.companions, *gpu.vfs]:
            what = "GPU" if address == gpu.address else "companion" if address in gpu.companions else "VF"
            fn = snapshot.function(address)
            if fn is None:
                raise RequestError(
                    "inconsistent_hardware",
                    f"GPU {gpu.address}: its {what} {address} is gone (a link names a function the host no "
                    "longer has); rescan the PCI bus or fix the hardware, then plan again",
                )
            if fn.vendor < 0 or fn.device < 0 or fn.class_code < 0:
                raise RequestError(
                    "inconsistent_hardware",
                    f"GPU {gpu.address}: its {what} {address} has unreadable ids (a phantom function); "
                    "rescan the PCI bus, then plan again",
                )
            prefix = f"{PCI_DEVICES}/{address}/"
            dangling = [
                p
                for p in snapshot.problems
                if p.startswith(prefix) and ("dangling link" in p or "partial group" in p)
            ]
            if dangling:
                raise RequestError(
                    "inconsistent_hardware",
                    f"GPU {gpu.address}: its {what} {address} is inconsistent ({dangling[0]}); "
                    "rescan the PCI bus or fix the hardware, then plan again",
                )


def _requested_gpus(snapshot: HostSnapshot, request: SwitchRequest) -> list[Gpu]:
    present = [g.address for g in snapshot.gpus]
    if not snapshot.gpus:
        raise RequestError("unknown_gpu", f"host {snapshot.hostname} has no NVIDIA GPU")
    if not request.gpus:
        return list(snapshot.gpus)
    wanted: set[str] = set()
    for text in request.gpus:
        address = parse_address(text)
        if snapshot.gpu(address) is None:
            raise RequestError("unknown_gpu", f"no GPU {address} on host {snapshot.hostname}", present)
        wanted.add(address)
    return [g for g in snapshot.gpus if g.address in wanted]


def check_options(request: SwitchRequest) -> None:
    """Which options go with which mode (part of :func:`parse_request`; checked again when planning, for
    requests built in code)."""
    if request.mode is not Mode.VGPU and (request.vgpu_type is not None or request.vgpu_count is not None):
        raise RequestError(
            "invalid_option", f"vgpu_type / vgpu_count only apply to mode vgpu, not {request.mode.value}"
        )
    if request.mode is not Mode.PASSTHROUGH and request.passthrough_alias is not None:
        raise RequestError(
            "invalid_option", f"passthrough_alias only applies to mode passthrough, not {request.mode.value}"
        )
    if request.vgpu_count is not None and request.vgpu_count < 1:
        raise RequestError("invalid_option", f"vgpu_count must be at least 1, got {request.vgpu_count}")
    if request.passthrough_alias is not None and not request.passthrough_alias.strip():
        raise RequestError("invalid_option", "passthrough_alias must not be empty")


def check_compatible(snapshot: HostSnapshot, after: Mapping[str, Mode], requested: set[str]) -> None:
    """Refuse a result holding accel and vgpu GPUs at once: they need two builds of one kernel module."""
    driver_modes = {m for m in after.values() if m in HOST_DRIVER_MODES}
    if len(driver_modes) < 2:
        return
    staying = sorted(a for a, m in after.items() if a not in requested and m in HOST_DRIVER_MODES)
    moving = sorted(a for a in requested if after[a] in HOST_DRIVER_MODES)
    target = after[moving[0]] if moving else Mode.VGPU
    others = {after[a] for a in staying}
    choices = [m.value for m in REQUESTABLE if not ({m} | others) >= HOST_DRIVER_MODES]
    raise RequestError(
        "incompatible_modes",
        f"GPU(s) {', '.join(moving)} would be {target.value} while {', '.join(staying)} stay "
        f"{'/'.join(sorted(m.value for m in others))}: the data-center driver and the vGPU manager cannot be "
        "loaded together; include those GPUs in the request or switch them first",
        choices,
    )


def _vgpu_choice(snapshot: HostSnapshot, gpu: Gpu, request: SwitchRequest, catalog: Catalog) -> VgpuChoice:
    offer = vgpu_offer(snapshot, gpu, catalog)
    assert offer is not None  # allowed_modes refused vgpu otherwise
    names = [t.name for t in offer.types]
    if request.vgpu_type is None:
        current = _current_type(snapshot, gpu, offer)
        if current is None:
            raise RequestError(
                "vgpu_type_required", f"switching GPU {gpu.address} to vgpu needs a vGPU type", names
            )
        vtype = current
    else:
        found = offer.find(request.vgpu_type)
        if found is None:
            raise RequestError(
                "vgpu_type_not_offered",
                f"GPU {gpu.address} ({gpu.name}) does not offer vGPU type {request.vgpu_type!r}",
                names,
            )
        vtype = found
    limit = vtype.max_instances
    if offer.parent == "vf" and offer.num_vfs:
        limit = min(limit, offer.num_vfs)  # one vGPU per VF
    if request.vgpu_count is not None:
        count = request.vgpu_count
    elif request.vgpu_type is None:
        count = _current_count(snapshot, gpu)  # a bare "vgpu" re-request keeps the layout as it is
    else:
        count = limit
    if count > limit:
        raise RequestError(
            "vgpu_count_exceeds",
            f"GPU {gpu.address} holds at most {limit} vGPU(s) of type {vtype.name}, {count} requested",
            [str(n) for n in range(1, limit + 1)],
        )
    return VgpuChoice(offer, vtype, count)


def _current_type(snapshot: HostSnapshot, gpu: Gpu, offer: VgpuOffer) -> VgpuType | None:
    """The type the GPU's vGPUs have now (a vgpu GPU re-requested without a type keeps it)."""
    if gpu.mode is not Mode.VGPU:
        return None
    for fn in (snapshot.function(a) for a in [gpu.address, *gpu.vfs]):
        if fn is None:
            continue
        for mdev in fn.mdevs:
            found = offer.find(mdev.type_id)
            if found is not None:
                return found
        if fn.vendor_vgpu is not None and fn.vendor_vgpu.current:
            found = offer.find(str(fn.vendor_vgpu.current))
            if found is not None:
                return found
    return None


def _current_count(snapshot: HostSnapshot, gpu: Gpu) -> int:
    count = 0
    for fn in (snapshot.function(a) for a in [gpu.address, *gpu.vfs]):
        if fn is not None:
            count += len(fn.mdevs) + (1 if fn.vendor_vgpu is not None and fn.vendor_vgpu.current else 0)
    return count
