"""Pure types shared by every layer of gpumode.

Nothing here touches the host or imports other gpumode modules: the host layer fills these types, the mode
engine plans with them, the server stores them. Snapshots are plain dataclasses (fast to build, fast to
import); their JSON form is the documented, versioned wire schema (see ``docs/snapshot-schema.md``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, Literal

SNAPSHOT_SCHEMA = "gpumode.snapshot/v1"

NVIDIA_VENDOR = 0x10DE
CLASS_VGA = 0x030000
CLASS_3D = 0x030200
CLASS_NVSWITCH = 0x068000
GPU_CLASSES = frozenset({CLASS_VGA, CLASS_3D})


class Mode(StrEnum):
    """What a GPU is used for. ``none`` means no driver holds it (or an unknown one does)."""

    ACCEL = "accel"
    VGPU = "vgpu"
    PASSTHROUGH = "passthrough"
    NONE = "none"
    UNKNOWN = "unknown"  # on nvidia, but which build could not be told (conflicting or no evidence)


class DriverState(StrEnum):
    """One word for the whole host's driver situation."""

    DATACENTER = "datacenter"  # nvidia data-center driver owns the GPUs
    VGPU_HOST = "vgpu-host"  # nvidia vGPU manager owns the GPUs
    VFIO = "vfio"  # every GPU is on vfio-pci
    NONE = "none"  # no GPU has a driver
    MIXED = "mixed"  # GPUs are split between the above
    UNKNOWN = "unknown"  # a GPU's mode could not be told (see the problems)


class Flavour(StrEnum):
    """The two builds of the ``nvidia`` kernel module; they cannot be installed or loaded side by side."""

    DATACENTER = "datacenter"
    VGPU = "vgpu"


class PciAddressError(ValueError):
    """A string is not a PCI address of the form ``DDDD:BB:DD.F``."""


_BDF = re.compile(r"^(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([01][0-9a-fA-F])\.([0-7])$")


@dataclass(frozen=True, order=True, slots=True)
class PciAddress:
    """A PCI function address (domain, bus, device, function)."""

    domain: int
    bus: int
    device: int
    function: int

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        """Parse ``0000:3b:00.0`` (or the short ``3b:00.0``, domain 0)."""
        m = _BDF.match(text.strip())
        if not m or int(m.group(3), 16) > 0x1F:
            raise PciAddressError(f"not a PCI address: {text!r} (expected DDDD:BB:DD.F, e.g. 0000:3b:00.0)")
        return cls(int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16), int(m.group(4)))

    @property
    def routing_id(self) -> int:
        return (self.bus << 8) | (self.device << 3) | self.function

    @classmethod
    def from_routing_id(cls, domain: int, rid: int) -> PciAddress:
        return cls(domain, (rid >> 8) & 0xFF, (rid >> 3) & 0x1F, rid & 0x7)

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.device:02x}.{self.function:x}"


def normalize_address(text: str) -> str:
    """The canonical string form of a PCI address; raises :class:`PciAddressError` on bad input."""
    return str(PciAddress.parse(text))


MAX_BUS = 0xFF
U16_MAX = 0xFFFF  # offset, stride and VF counts are 16-bit fields of the SR-IOV capability


class SriovLayoutError(ValueError):
    """A PF's VF addresses cannot be worked out (unknown or impossible layout); the message names the PF."""

    def __init__(self, pf: str, reason: str) -> None:
        super().__init__(f"{pf}: {reason}")
        self.pf = pf
        self.reason = reason


def vf_addresses(pf: str, offset: int, stride: int, count: int) -> list[str]:
    """The addresses the kernel gives VFs ``0 … count-1`` of ``pf``, known before they are enabled.

    ``drivers/pci/iov.c`` (``pci_iov_virtfn_bus``/``_devfn``): VF n's routing id (bus << 8 | devfn) is
    the PF's + ``offset`` + n × ``stride``; the carry out of devfn goes into the bus number, so a VF can sit
    on a higher bus than its PF. Raises :class:`SriovLayoutError` where the kernel refuses the layout:
    offset 0 (VF 0 would be the PF), stride 0 with several VFs (``sriov_init``), a VF past bus 0xff
    (``sriov_enable``).
    """
    base = PciAddress.parse(pf)
    name = str(base)
    for label, value in (("sriov_offset", offset), ("sriov_stride", stride), ("VF count", count)):
        if not 0 <= value <= U16_MAX:
            raise SriovLayoutError(name, f"{label} {value} is not a 16-bit count")
    if count == 0:
        return []
    if offset == 0:
        raise SriovLayoutError(name, "sriov_offset is 0: VF 0 would be the PF itself")
    if count > 1 and stride == 0:
        raise SriovLayoutError(name, f"sriov_stride is 0: its {count} VFs would share one address")
    first = base.routing_id + offset
    last = first + (count - 1) * stride
    if last >> 8 > MAX_BUS:
        where = f"VF {count - 1} would be on bus {last >> 8:#x}"
        raise SriovLayoutError(name, f"{where}, past bus 0xff: there is no room for {count} VFs")
    return [str(PciAddress.from_routing_id(base.domain, first + n * stride)) for n in range(count)]


@dataclass(slots=True)
class MdevType:
    """One entry of a parent's ``mdev_supported_types``."""

    type_id: str  # e.g. "nvidia-222"
    name: str  # e.g. "GRID T4-1Q"
    description: str
    available_instances: int
    device_api: str


@dataclass(slots=True)
class Mdev:
    """An existing mediated device."""

    uuid: str
    type_id: str
    parent: str


@dataclass(slots=True)
class VendorVgpu:
    """The vGPU 17+ vendor VFIO interface of one VF (``<VF>/nvidia/``)."""

    creatable: dict[int, str]  # vGPU type id -> name, from creatable_vgpu_types
    current: int  # current_vgpu_type; 0 = none


@dataclass(slots=True)
class Sriov:
    """SR-IOV facts of a physical function."""

    total_vfs: int
    num_vfs: int
    vfs: list[str] = field(default_factory=list)
    # where the VFs go (sriov_offset, sriov_stride); None when unreadable or reported by an older agent
    offset: int | None = None
    stride: int | None = None


@dataclass(slots=True)
class PciFunction:
    """Everything discovery knows about one PCI function."""

    address: str
    vendor: int
    device: int
    subsystem_vendor: int
    subsystem_device: int
    class_code: int
    revision: int
    numa_node: int | None = None
    iommu_group: int | None = None
    driver: str | None = None
    driver_override: str | None = None
    vendor_name: str | None = None
    device_name: str | None = None
    class_name: str | None = None
    physfn: str | None = None  # set on a VF: its PF
    sriov: Sriov | None = None  # set on a PF with SR-IOV capability
    mdev_types: list[MdevType] = field(default_factory=list)
    mdevs: list[Mdev] = field(default_factory=list)
    vendor_vgpu: VendorVgpu | None = None
    consumers: list[str] = field(default_factory=list)  # ``consumer:pci:`` device links
    boot_vga: bool | None = None  # ``boot_vga`` (VGA class only): the firmware console is on it; None: none

    @property
    def is_vf(self) -> bool:
        return self.physfn is not None

    @property
    def is_nvidia_gpu(self) -> bool:
        # any programming interface: the class file carries it in its low byte
        return self.vendor == NVIDIA_VENDOR and self.class_code & 0xFFFF00 in GPU_CLASSES and not self.is_vf

    def vf_addresses(self, count: int | None = None) -> list[str]:
        """The addresses of this PF's first ``count`` VFs (default: all ``sriov_totalvfs``), whether they are
        enabled or not: what ``virtfn<N>`` will point at. Raises :class:`SriovLayoutError` when the snapshot
        cannot tell (no SR-IOV, offset/stride unknown) or the layout is impossible."""
        sriov = self.sriov
        if sriov is None:
            raise SriovLayoutError(self.address, "has no SR-IOV capability (no sriov_totalvfs)")
        if sriov.offset is None or sriov.stride is None:
            raise SriovLayoutError(
                self.address,
                "the snapshot does not give its sriov_offset and sriov_stride (unreadable, or reported by an "
                "agent older than these fields), so its VF addresses are unknown until the VFs exist",
            )
        wanted = sriov.total_vfs if count is None else count
        if wanted > sriov.total_vfs:
            raise SriovLayoutError(
                self.address, f"{wanted} VFs asked for, but sriov_totalvfs is {sriov.total_vfs}"
            )
        return vf_addresses(self.address, sriov.offset, sriov.stride, wanted)


@dataclass(slots=True)
class Gpu:
    """A physical NVIDIA GPU (never a VF) and what belongs with it."""

    address: str
    device: int
    name: str
    numa_node: int | None
    iommu_group: int | None
    driver: str | None
    mode: Mode
    companions: list[str] = field(default_factory=list)  # other functions of its IOMMU group + consumer links
    vfs: list[str] = field(default_factory=list)
    mdevs: list[str] = field(default_factory=list)  # uuids of mdevs on it or its VFs
    vgpus: list[str] = field(default_factory=list)  # VFs with a vendor vGPU type set


@dataclass(slots=True)
class LoadedModule:
    """One line of ``/proc/modules``."""

    name: str
    size: int
    refcount: int
    users: list[str]
    state: str


@dataclass(slots=True)
class Package:
    """An installed driver package."""

    name: str
    version: str
    flavour: Flavour | None = None


@dataclass(slots=True)
class NvidiaDriver:
    """The NVIDIA driver as the host shows it."""

    loaded: bool = False
    flavour: Flavour | None = None
    version: str | None = None
    open_kernel_module: bool | None = None
    vgpu_vfio_loaded: bool = False
    packages: list[Package] = field(default_factory=list)
    services: dict[str, bool] = field(default_factory=dict)  # unit name -> active


@dataclass(slots=True)
class HostSnapshot:
    """What one host looks like right now. The fingerprint covers everything but itself."""

    hostname: str
    kernel: str | None
    functions: list[PciFunction]
    gpus: list[Gpu]
    nvswitches: list[str]
    modules: list[LoadedModule]
    nvidia: NvidiaDriver
    driver_state: DriverState
    problems: list[str] = field(default_factory=list)
    schema: str = SNAPSHOT_SCHEMA
    fingerprint: str = ""

    def function(self, address: str) -> PciFunction | None:
        for fn in self.functions:
            if fn.address == address:
                return fn
        return None

    def gpu(self, address: str) -> Gpu | None:
        for gpu in self.gpus:
            if gpu.address == address:
                return gpu
        return None

    def to_dict(self) -> dict[str, Any]:
        """What ``dataclasses.asdict`` gives (same keys, same order), several times faster: the server and
        the agent build it for every report."""
        plain: dict[str, Any] = _plain(self)
        return plain

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=indent is not None)

    def compute_fingerprint(self) -> str:
        return fingerprint_of(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostSnapshot:
        """Rebuild a snapshot from its JSON form (no validation beyond shape; the server validates)."""
        fns = []
        for f in data["functions"]:
            f = dict(f)
            f["sriov"] = Sriov(**f["sriov"]) if f.get("sriov") else None
            f["mdev_types"] = [MdevType(**t) for t in f.get("mdev_types", [])]
            f["mdevs"] = [Mdev(**m) for m in f.get("mdevs", [])]
            vv = f.get("vendor_vgpu")
            f["vendor_vgpu"] = (
                VendorVgpu({int(k): v for k, v in vv["creatable"].items()}, vv["current"]) if vv else None
            )
            fns.append(PciFunction(**f))
        gpus = [Gpu(**{**g, "mode": Mode(g["mode"])}) for g in data["gpus"]]
        nv = dict(data["nvidia"])
        nv["flavour"] = Flavour(nv["flavour"]) if nv.get("flavour") else None
        nv["packages"] = [
            Package(p["name"], p["version"], Flavour(p["flavour"]) if p.get("flavour") else None)
            for p in nv.get("packages", [])
        ]
        return cls(
            hostname=data["hostname"],
            kernel=data.get("kernel"),
            functions=fns,
            gpus=gpus,
            nvswitches=list(data.get("nvswitches", [])),
            modules=[LoadedModule(**m) for m in data.get("modules", [])],
            nvidia=NvidiaDriver(**nv),
            driver_state=DriverState(data["driver_state"]),
            problems=list(data.get("problems", [])),
            schema=data.get("schema", SNAPSHOT_SCHEMA),
            fingerprint=data.get("fingerprint", ""),
        )


def fingerprint_of(body: dict[str, Any]) -> str:
    """The fingerprint of a snapshot in its ``to_dict()`` form (``fingerprint`` itself left out); ``body`` is
    not changed."""
    body = {**body, "functions": [_without_unset_additions(fn) for fn in body["functions"]]}
    body.pop("fingerprint", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_LEAVES = (str, int, bool, float, type(None))


def _plain(value: Any) -> Any:
    """``dataclasses.asdict`` for the snapshot's types: dataclasses become dicts (fields in order), lists and
    dicts are copied, everything else (str, int, enums) is kept as it is, as asdict keeps it."""
    cls = type(value)
    if cls in _LEAVES:
        return value
    if cls is list:
        return [_plain(v) for v in value]
    if cls is dict:
        return {k: _plain(v) for k, v in value.items()}
    if cls is tuple:
        return tuple(_plain(v) for v in value)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        if not hasattr(cls, "__dataclass_fields__"):
            return value
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(value))
    return {name: _plain(getattr(value, name)) for name in names}


# Fields added to v1 after agents shipped without them: an older agent's JSON lacks them, and its fingerprint
# (of what it sent) must still be the fingerprint of the snapshot the server rebuilds with their defaults.
_SRIOV_ADDITIONS = ("offset", "stride")
_FUNCTION_ADDITIONS = ("boot_vga",)


def _without_unset_additions(fn: dict[str, Any]) -> dict[str, Any]:
    """A function without the additions that hold their default (None): the canonical form the fingerprint
    hashes. Copies only what it changes."""
    unset_here = [key for key in _FUNCTION_ADDITIONS if key in fn and fn[key] is None]
    if unset_here:
        fn = {k: v for k, v in fn.items() if k not in unset_here}
    sriov = fn.get("sriov")
    if not sriov or all(sriov.get(key) is not None for key in _SRIOV_ADDITIONS):
        return fn
    return {**fn, "sriov": {k: v for k, v in sriov.items() if k not in _SRIOV_ADDITIONS or v is not None}}


# --- plans --------------------------------------------------------------------------------------------------


class StepState(StrEnum):
    """The one vocabulary of a plan step's state: in the host's journal, in a server job and in the API."""

    PENDING = "pending"
    RUNNING = "running"  # the journal records it before apply: after a crash nobody knows whether apply ran
    STARTED = "running"  # the journal's name for it until 2026-12 (an alias: the same member)
    DONE = "done"
    SKIPPED = "skipped"  # already done when checked, or a cloud step the local engine does not run
    FAILED = "failed"
    UNDOING = "undoing"
    UNDONE = "undone"

    @classmethod
    def _missing_(cls, value: object) -> StepState | None:
        # journals written before the vocabulary was one still read
        return cls.RUNNING if value == "started" else None


DeviceKind = Literal["pci", "mdev"]


@dataclass(frozen=True, slots=True)
class VmDevice:
    """A host device in a VM's definition: a PCI function (passthrough GPU, vGPU VF) or an mdev."""

    kind: DeviceKind
    id: str  # PCI address ("0000:3b:00.0") or mdev uuid

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"


@dataclass(slots=True)
class Vm:
    """A VM defined on a host, as its hypervisor lists it (and its agent reports it)."""

    name: str
    uuid: str
    running: bool
    devices: list[VmDevice] = field(default_factory=list)


class VmPolicy(StrEnum):
    """What a switch may do to running VMs."""

    ALL = "all"  # shut down every VM on the host (the original method)
    GPU = "gpu"  # only VMs holding this host's GPU devices
    REFUSE = "refuse"  # fail the plan if any VM would be touched


@dataclass(slots=True)
class SwitchRequest:
    """What an operator asks for: a target mode for the whole host or some GPUs, with the mode's options."""

    mode: Mode
    gpus: list[str] = field(default_factory=list)  # empty: every GPU of the host
    vgpu_type: str | None = None  # vGPU type name ("NVIDIA L40S-4Q") or id ("nvidia-1150" / "1150")
    vgpu_count: int | None = None  # per GPU; None: as many as the type allows
    passthrough_alias: str | None = None
    vm_policy: VmPolicy = VmPolicy.GPU
    restart_vms: bool = True  # after the host steps, start again the VMs it shut down that keep their devices
    allow_boot_vga: bool = False  # passthrough may take the boot display GPU (its console goes dark)


@dataclass(slots=True)
class Step:
    """One idempotent action of a plan. ``action`` names what runs it (see ``gpumode.modes.steps``)."""

    id: str  # unique within the plan, stable: "03-module.unload-nvidia_uvm"
    action: str  # "vm.shutdown", "module.unload", "bind.vfio", "cloud.register_cards", ...
    target: str  # what it acts on: a VM name, module, PCI address, package flavour, ...
    params: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    where: str = "host"  # "host" (agent / local engine) or "cloud" (server)
    estimate_s: float = 1.0


@dataclass(slots=True)
class Impact:
    """What a plan will do to the host, shown before anything runs."""

    gpus: dict[str, tuple[Mode, Mode]] = field(default_factory=dict)  # address -> (now, after)
    vms_stopped: list[str] = field(default_factory=list)
    vms_restarted: list[str] = field(default_factory=list)  # stopped, then started again after the host steps
    vms_left_stopped: list[str] = field(default_factory=list)  # stopped and lost devices: the cloud's to move
    devices_detached: list[str] = field(default_factory=list)  # "vm: kind:id"
    vgpus_reclaimed: list[str] = field(default_factory=list)
    modules_unloaded: list[str] = field(default_factory=list)
    modules_loaded: list[str] = field(default_factory=list)
    packages_removed: list[str] = field(default_factory=list)
    packages_installed: list[str] = field(default_factory=list)
    driver_change: bool = False
    reboot_required: bool = False
    estimated_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # what the plan could not consider, e.g. no hypervisor


@dataclass(slots=True)
class Plan:
    """An ordered list of steps plus their impact.

    Pure data: shown by --dry-run, stored with a job, executed."""

    hostname: str
    request: SwitchRequest
    steps: list[Step]
    impact: Impact
    snapshot_fingerprint: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
