"""The emulated kernel's memory: one JSON document under ``DIR/.gpumode-emulated/state.json``.

A real kernel keeps this state in RAM; the emulation keeps it on disk so that every process pointed at the
same directory (the CLI, the agent, a test's subprocess) sees the same host. Each kernel operation takes an
``fcntl`` lock (:func:`locked`), loads, acts on the in-memory copy, and only if the operation succeeded
saves it atomically (tmp + rename, :func:`commit`). A failing write therefore changes nothing, as a rejected
``write(2)`` would.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import operator
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from gpumode.emulated.spec import GpuModelSpec, VgpuTypeSpec

MARKER = ".gpumode-emulated"
STATE_FILE = "state.json"
LOCK_FILE = "lock"
PREVIOUS_FILE = "state.prev.json"
STATE_VERSION = 1

HandleKind = Literal["nvidia", "vfio", "mdev"]


@dataclass(slots=True)
class Device:
    """One PCI function the hardware has (present or hot-removed), with the kernel's per-device state."""

    address: str
    vendor: int
    device: int
    class_code: int
    revision: int = 0
    subsystem_vendor: int = 0
    subsystem_device: int = 0
    parent: str | None = None  # upstream bridge address; None: root bus
    numa_node: int = -1
    iommu_group: int | None = None
    gpu_model: str | None = None
    consumers: list[str] = field(default_factory=list)
    pcie: bool = True
    irq: int = 0
    physfn: str | None = None  # set on VFs
    vf_index: int | None = None
    present: bool = True  # False after a `remove`; `rescan` brings it back
    driver: str | None = None
    driver_override: str | None = None
    enable_cnt: int = 0
    sriov_total_vfs: int = 0  # SR-IOV capability (0: none)
    sriov_offset: int = 1
    sriov_stride: int = 1
    sriov_vf_device: int = 0
    sriov_numvfs: int = 0
    sriov_drivers_autoprobe: bool = True
    vfio_index: int | None = None  # vfio-dev/vfioN while a VFIO driver holds it
    vgpu_type: int = 0  # vendor interface: <VF>/nvidia/current_vgpu_type
    unbind_lock: bool = False  # /proc/driver/nvidia/gpus/<BDF>/unbindLock
    gpu_uuid: str = ""

    @property
    def is_vf(self) -> bool:
        return self.physfn is not None

    @property
    def is_bridge(self) -> bool:
        return (self.class_code >> 8) == 0x0604


@dataclass(slots=True)
class MatchRule:
    """One entry of a PCI driver's id table (``PCI_ANY_ID`` is ``None``)."""

    vendor: int | None = None
    device: int | None = None
    subvendor: int | None = None
    subdevice: int | None = None
    class_code: int = 0
    class_mask: int = 0
    override_only: bool = False

    def matches(self, dev: Device) -> bool:
        return (
            (self.vendor is None or self.vendor == dev.vendor)
            and (self.device is None or self.device == dev.device)
            and (self.subvendor is None or self.subvendor == dev.subsystem_vendor)
            and (self.subdevice is None or self.subdevice == dev.subsystem_device)
            and (dev.class_code & self.class_mask) == (self.class_code & self.class_mask)
        )


@dataclass(slots=True)
class Driver:
    """A registered ``pci_driver`` (``sys/bus/pci/drivers/<name>``)."""

    name: str
    module: str | None  # None: built into the kernel (pcieport)
    ids: list[MatchRule] = field(default_factory=list)
    dynids: list[MatchRule] = field(default_factory=list)  # added through new_id
    sriov_configure: bool = False
    managed_dma: bool = False  # driver_managed_dma: compatible with a VFIO-owned IOMMU group
    vfio: bool = False  # registers a VFIO device per bound function (vfio-dev/vfioN, /dev/vfio/<group>)


@dataclass(slots=True)
class LoadedModule:
    """A loaded module, as read from its ``.ko`` at load time (later package changes do not alter it)."""

    name: str
    version: str = ""
    license: str = "GPL"
    flavour: str = ""  # nvidia builds: "datacenter" | "vgpu"
    build: str = ""  # nvidia builds: "proprietary" | "open"
    size: int = 16384
    depends: list[str] = field(default_factory=list)
    drivers: list[str] = field(default_factory=list)


@dataclass(slots=True)
class MdevState:
    uuid: str
    parent: str
    type_id: int
    iommu_group: int


@dataclass(slots=True)
class Handle:
    """An open file on a device node: a ``/dev/nvidia*`` client, or a VM holding a VFIO device or an mdev."""

    holder: str
    kind: HandleKind
    target: str  # PCI address (nvidia, vfio) or mdev uuid


@dataclass(slots=True)
class Fault:
    """Make the next ``count`` operations on ``key`` fail with ``errno`` (test fault injection)."""

    key: str  # a resolved write path ("sys/bus/pci/drivers/nvidia/unbind") or "load:<mod>" / "unload:<mod>"
    errno: int
    count: int = 1


@dataclass(slots=True)
class KernelState:
    hostname: str
    kernel_release: str
    iommu: bool
    models: dict[str, GpuModelSpec]
    devices: dict[str, Device]
    drivers: dict[str, Driver] = field(default_factory=dict)  # registration order matters for probing
    modules: list[LoadedModule] = field(default_factory=list)  # load order
    mdevs: dict[str, MdevState] = field(default_factory=dict)
    handles: list[Handle] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    bus_autoprobe: bool = True
    cmdline: str = ""
    version: int = STATE_VERSION

    # --- lookups used everywhere ---------------------------------------------------------------------------

    def present(self, address: str) -> Device | None:
        dev = self.devices.get(address)
        return dev if dev is not None and dev.present else None

    def present_devices(self) -> list[Device]:
        return sorted((d for d in self.devices.values() if d.present), key=lambda d: d.address)

    def module(self, name: str) -> LoadedModule | None:
        return next((m for m in self.modules if m.name == name), None)

    def model_of(self, dev: Device) -> GpuModelSpec | None:
        """The GPU model of a PF, or of a VF's PF."""
        key = dev.gpu_model
        if key is None and dev.physfn is not None:
            key = self.devices[dev.physfn].gpu_model
        return self.models.get(key) if key else None

    def vfs_of(self, pf: str) -> list[Device]:
        return sorted(
            (d for d in self.devices.values() if d.physfn == pf and d.present), key=lambda d: d.vf_index or 0
        )

    def free_vfio_index(self) -> int:
        """Lowest unused vfio-dev index (the kernel allocates them with an IDA)."""
        used = {d.vfio_index for d in self.devices.values() if d.vfio_index is not None}
        return _lowest_free(used)

    def free_iommu_group(self) -> int:
        """Lowest group number no device (present or hot-removed) nor mdev uses."""
        used = {d.iommu_group for d in self.devices.values() if d.iommu_group is not None}
        used |= {m.iommu_group for m in self.mdevs.values()}
        return _lowest_free(used)

    def holders_of(self, module: str) -> list[str]:
        """Loaded modules that depend on ``module``, most recently loaded first (as lsmod prints them)."""
        return [m.name for m in reversed(self.modules) if module in m.depends]


def _lowest_free(used: set[int]) -> int:
    value = 0
    while value in used:
        value += 1
    return value


# --- (de)serialisation --------------------------------------------------------------------------------------


def _model_from_dict(data: dict[str, Any]) -> GpuModelSpec:
    body = dict(data)
    body["vgpu_types"] = tuple(VgpuTypeSpec(**t) for t in body.get("vgpu_types", ()))
    return GpuModelSpec(**body)


def _driver_from_dict(data: dict[str, Any]) -> Driver:
    body = dict(data)
    body["ids"] = [MatchRule(**r) for r in body.get("ids", [])]
    body["dynids"] = [MatchRule(**r) for r in body.get("dynids", [])]
    return Driver(**body)


_GETTERS: dict[type, tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]] = {}


def _getter(cls: type) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]:
    getter = _GETTERS.get(cls)
    if getter is None:
        names = tuple(f.name for f in fields(cls))
        getter = _GETTERS[cls] = (names, operator.attrgetter(*names))
    return getter


def _fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, one level deep: ``asdict`` without its recursive deep copy, which
    made saving the slowest part of a write. Every class here has at least two fields (attrgetter of
    several names returns a tuple)."""
    names, get = _getter(type(obj))
    return dict(zip(names, get(obj), strict=True))


def _model_dict(model: GpuModelSpec) -> dict[str, Any]:
    body = _fields(model)
    body["vgpu_types"] = [_fields(t) for t in model.vgpu_types]
    return body


def _device_dict(dev: Device) -> dict[str, Any]:
    body = _fields(dev)
    body["consumers"] = list(dev.consumers)
    return body


def _module_dict(mod: LoadedModule) -> dict[str, Any]:
    body = _fields(mod)
    body["depends"], body["drivers"] = list(mod.depends), list(mod.drivers)
    return body


def _driver_dict(drv: Driver) -> dict[str, Any]:
    body = _fields(drv)
    body["ids"] = [_fields(r) for r in drv.ids]
    body["dynids"] = [_fields(r) for r in drv.dynids]
    return body


def to_dict(state: KernelState) -> dict[str, Any]:
    """The state as JSON-ready data (what ``dataclasses.asdict`` gives, built directly)."""
    return {
        "hostname": state.hostname,
        "kernel_release": state.kernel_release,
        "iommu": state.iommu,
        "models": {k: _model_dict(v) for k, v in state.models.items()},
        "devices": {k: _device_dict(v) for k, v in state.devices.items()},
        "drivers": {k: _driver_dict(v) for k, v in state.drivers.items()},
        "modules": [_module_dict(m) for m in state.modules],
        "mdevs": {k: _fields(v) for k, v in state.mdevs.items()},
        "handles": [_fields(h) for h in state.handles],
        "faults": [_fields(f) for f in state.faults],
        "bus_autoprobe": state.bus_autoprobe,
        "cmdline": state.cmdline,
        "version": state.version,
    }


def from_dict(data: dict[str, Any]) -> KernelState:
    if data.get("version") != STATE_VERSION:
        raise ValueError(f"emulated kernel state version {data.get('version')!r}, expected {STATE_VERSION}")
    return KernelState(
        hostname=data["hostname"],
        kernel_release=data["kernel_release"],
        iommu=data["iommu"],
        models={k: _model_from_dict(v) for k, v in data["models"].items()},
        devices={k: Device(**v) for k, v in data["devices"].items()},
        drivers={k: _driver_from_dict(v) for k, v in data["drivers"].items()},
        modules=[LoadedModule(**m) for m in data["modules"]],
        mdevs={k: MdevState(**v) for k, v in data["mdevs"].items()},
        handles=[Handle(**h) for h in data["handles"]],
        faults=[Fault(**f) for f in data["faults"]],
        bus_autoprobe=data["bus_autoprobe"],
        cmdline=data["cmdline"],
        version=data["version"],
    )


# --- storage ------------------------------------------------------------------------------------------------


def marker_dir(root: Path) -> Path:
    return root / MARKER


def read_text(root: Path) -> str:
    """The saved state, unparsed (the kernel keys its cache of the rendered tree on it)."""
    path = marker_dir(root) / STATE_FILE
    try:
        return path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, f"not an emulated host (no {MARKER}/{STATE_FILE})", str(root)
        ) from None


def parse(text: str) -> KernelState:
    return from_dict(json.loads(text))


def dumps(state: KernelState) -> str:
    """Deterministic (sorted keys), so equal states give equal text. Not indented: the C encoder only
    handles the compact form, and this runs on every write (``python -m json.tool`` reads it back)."""
    return json.dumps(to_dict(state), sort_keys=True, separators=(",", ":"))


def load(root: Path) -> KernelState:
    return parse(read_text(root))


def save(root: Path, state: KernelState) -> None:
    store(root, dumps(state))


def store(root: Path, text: str) -> None:
    """Write atomically: a reader never sees half a state, a crash leaves the previous one."""
    directory = marker_dir(root)
    tmp = directory / f".{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(text)
    os.replace(tmp, directory / STATE_FILE)


# --- a state change and the file updates that follow it -----------------------------------------------------
# The tree on disk is updated after the new state is saved. If the process dies in between, the next
# transaction must know which state the files were rendered from to finish the update: commit() keeps it as
# state.prev.json (a hard link, so nothing is copied) until done() says the files match the new state.


def commit(root: Path, text: str) -> None:
    """Save ``text`` as the state while keeping the current one as the files' previous state."""
    directory = marker_dir(root)
    previous = directory / PREVIOUS_FILE
    try:
        os.link(directory / STATE_FILE, previous)
    except FileExistsError:  # an unfinished update: its start is what the files may still show, keep it
        pass
    except OSError:  # a filesystem without hard links: copy, atomically
        tmp = directory / f".{PREVIOUS_FILE}.{os.getpid()}.tmp"
        tmp.write_text(read_text(root))
        os.replace(tmp, previous)
    store(root, text)


def done(root: Path) -> None:
    """The files now match the saved state."""
    (marker_dir(root) / PREVIOUS_FILE).unlink(missing_ok=True)


def interrupted(root: Path) -> str | None:
    """The state the files were being updated from when a process died mid-way, else None."""
    try:
        return (marker_dir(root) / PREVIOUS_FILE).read_text()
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """Hold the host-wide lock: two processes acting on one emulated host take turns, as syscalls
    serialise."""
    directory = marker_dir(root)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_FILE, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
