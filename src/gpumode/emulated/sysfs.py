"""Render the kernel state as files: ``sys/``, ``proc/`` and the kernel's ``dev/`` nodes, in exact kernel
formats.

The tree is a pure function of :class:`KernelState`: :func:`render` returns every node (file with its bytes
and mode, symlink with its relative target, directory) plus the map of writable attributes to what a write
means. After each operation the kernel renders the new state and :func:`apply` changes only the difference
from the old one on disk, so a write costs a few file operations, and files not owned by the kernel
(``etc/``, ``usr/``, the userspace half's ``dev/`` entries) are never touched.

Speed without giving up purity: the files of one PCI function are a function of its :class:`DeviceView`
(its own fields plus what the rest of the state contributes to them), and :func:`render` memoises each
device's fragment by that view. A write re-renders only the devices whose view changed plus the small global
parts (bus, modules, ``proc``, ``dev``); everything else is the very same fragment object, so :func:`changes`
only looks at the fragments two trees do not share. :func:`set_caching` turns the memo (and the kernel's cache
of the last tree) off, for benchmarks and for tests that compare against a from-scratch render.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from gpumode.domain import CLASS_VGA, NVIDIA_VENDOR
from gpumode.emulated import configspace, handles, nvidia, pci
from gpumode.emulated.pci import parse_address
from gpumode.emulated.spec import VgpuTypeSpec
from gpumode.emulated.state import Device, KernelState

CPUS_PER_NODE = 32
NUMA_NODES = 2
MDEV_DRIVER = "nvidia-vgpu-vfio"  # NVIDIA's mdev_driver as sysfs names it (the module is nvidia_vgpu_vfio)
RESOURCE_LINES = 13
MEM_FLAGS = 0x40200
MEMO_LIMIT = 4096  # device fragments kept (~14 KB each); past it the memo starts over (tests make many hosts)


@dataclass(frozen=True, slots=True)
class File:
    data: bytes
    mode: int = 0o444


@dataclass(frozen=True, slots=True)
class Link:
    target: str  # relative, as the kernel makes them


@dataclass(frozen=True, slots=True)
class Dir:
    pass


Node = File | Link | Dir
# What a write to an attribute means: ("device", bdf, attr), ("driver", name, attr), ("bus", attr),
# ("mdev_type", parent, type_id), ("mdev", uuid), ("vgpu_type", bdf), ("unbind_lock", bdf)
Action = tuple[str, ...]
DIR = Dir()


@dataclass(slots=True)
class Tree:
    nodes: dict[str, Node] = field(default_factory=dict)
    writable: dict[str, Action] = field(default_factory=dict)
    # What render() merged ``nodes`` from; lets changes() look only at the parts two trees do not share.
    parts: tuple[_Fragment, ...] = ()

    def dir(self, path: str) -> None:
        """The directory and its parents; a path already there (whatever its kind) is left alone."""
        nodes = self.nodes
        while path not in nodes:  # a known path has its parents already: stop there
            nodes[path] = DIR
            head, sep, _ = path.rpartition("/")
            if not sep:
                return
            path = head

    def file(self, path: str, text: str | bytes, mode: int = 0o444, action: Action | None = None) -> None:
        self.dir(path.rpartition("/")[0])
        self.nodes[path] = File(text.encode() if isinstance(text, str) else text, mode)
        if action is not None:
            self.writable[path] = action

    def link(self, path: str, target: str) -> None:
        """``target`` is a root-relative path; stored relative to the link's directory, as sysfs does."""
        directory = path.rpartition("/")[0]
        self.dir(directory)
        self.nodes[path] = Link(relative(target, directory))

    def absolute_link(self, path: str, target: str) -> None:
        """A link whose target is kept as written (``proc/<pid>/fd/N -> /dev/vfio/3``, as procfs shows it)."""
        self.dir(path.rpartition("/")[0])
        self.nodes[path] = Link(target)


@dataclass(frozen=True, slots=True)
class _Fragment:
    """A rendered part of the tree, split so that merging keeps :meth:`Tree.dir`'s rule (a directory never
    replaces a file or a link) with plain dict updates."""

    dirs: dict[str, Node]
    items: dict[str, Node]
    writable: dict[str, Action]

    @classmethod
    def of(cls, tree: Tree) -> _Fragment:
        dirs: dict[str, Node] = {}
        items: dict[str, Node] = {}
        for path, node in tree.nodes.items():
            (dirs if isinstance(node, Dir) else items)[path] = node
        return cls(dirs, items, tree.writable)


def _merge(fragments: Iterable[_Fragment]) -> Tree:
    parts = tuple(fragments)
    dirs: dict[str, Node] = {}
    items: dict[str, Node] = {}
    writable: dict[str, Action] = {}
    for frag in parts:
        dirs.update(frag.dirs)
        items.update(frag.items)
        writable.update(frag.writable)
    dirs.update(items)  # files and links win over directories, as in Tree.dir
    return Tree(dirs, writable, parts)


def relative(target: str, directory: str) -> str:
    """``os.path.relpath(target, directory)`` for two normalised root-relative paths, without touching the
    filesystem or the working directory (it runs for every link of every render)."""
    t, d = target.split("/"), directory.split("/")
    common = 0
    for a, b in zip(t, d, strict=False):  # stops at the shorter one
        if a != b:
            break
        common += 1
    parts = [".."] * (len(d) - common) + t[common:]
    return "/".join(parts) if parts else "."


# --- caching ------------------------------------------------------------------------------------------------


class _Caching:
    enabled = os.environ.get("GPUMODE_EMULATED_FULL_RENDER", "") not in ("1", "true", "yes")


def caching_enabled() -> bool:
    return _Caching.enabled


def set_caching(enabled: bool) -> None:
    """Memoise device fragments (and let the kernel reuse the tree it rendered last) or render everything
    every time, as the emulation first did: two full renders per operation. Off is what
    ``bench/emulated.py`` sets side by side and what the invariant tests compare with;
    ``GPUMODE_EMULATED_FULL_RENDER=1`` starts a process with it off. What is cached stays (entries are keyed
    by content, so they cannot go stale) but is neither used nor added to while off."""
    _Caching.enabled = enabled


@contextlib.contextmanager
def caching(enabled: bool) -> Iterator[None]:
    """:func:`set_caching` for a block, then back to what it was."""
    before = _Caching.enabled
    set_caching(enabled)
    try:
        yield
    finally:
        set_caching(before)


_DEVICE_MEMO: dict[DeviceView, _Fragment] = {}


# --- paths --------------------------------------------------------------------------------------------------


def device_path(state: KernelState, dev: Device) -> str:
    """``sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0`` (VFs are siblings of their PF)."""
    parent = dev.parent
    if parent is None:
        addr = parse_address(dev.address)
        return f"sys/devices/pci{addr.domain:04x}:{addr.bus:02x}/{dev.address}"
    return f"{device_path(state, state.devices[parent])}/{dev.address}"


def driver_path(name: str) -> str:
    return f"sys/bus/pci/drivers/{name}"


# --- formats ------------------------------------------------------------------------------------------------


class PciIds(Protocol):
    """What the id-derived formats read: a :class:`Device` or a :class:`DeviceView`."""

    @property
    def address(self) -> str: ...
    @property
    def vendor(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def subsystem_vendor(self) -> int: ...
    @property
    def subsystem_device(self) -> int: ...
    @property
    def class_code(self) -> int: ...
    @property
    def driver(self) -> str | None: ...


def modalias(dev: PciIds) -> str:
    cc = dev.class_code
    return (
        f"pci:v{dev.vendor:08X}d{dev.device:08X}sv{dev.subsystem_vendor:08X}sd{dev.subsystem_device:08X}"
        f"bc{(cc >> 16) & 0xFF:02X}sc{(cc >> 8) & 0xFF:02X}i{cc & 0xFF:02X}"
    )


def cpulist(numa_node: int) -> str:
    if numa_node < 0:
        return f"0-{CPUS_PER_NODE * NUMA_NODES - 1}"
    return f"{numa_node * CPUS_PER_NODE}-{(numa_node + 1) * CPUS_PER_NODE - 1}"


def cpumask(numa_node: int) -> str:
    words = [0] * NUMA_NODES  # one 32-bit word per node, most significant first
    for node in range(NUMA_NODES) if numa_node < 0 else [numa_node]:
        words[NUMA_NODES - 1 - node] = 0xFFFFFFFF
    return ",".join(f"{w:08x}" for w in words)


def _bar0_mib(state: KernelState, dev: Device) -> int:
    model = state.model_of(dev)
    return model.bar0_mib if model else 1


def _bar0(address: str, class_code: int, bar0_mib: int) -> tuple[int, int] | None:
    """(start, size) of BAR 0, as ``resource`` and ``config`` both show it; bridges have none here."""
    if (class_code >> 8) == 0x0604:
        return None
    return 0x200000000000 + parse_address(address).routing_id * 0x100000000, bar0_mib << 20


def _resource(address: str, class_code: int, bar0_mib: int) -> str:
    lines = ["0x0000000000000000 0x0000000000000000 0x0000000000000000"] * RESOURCE_LINES
    bar = _bar0(address, class_code, bar0_mib)
    if bar is not None:
        start, size = bar
        lines[0] = f"0x{start:016x} 0x{start + size - 1:016x} 0x{MEM_FLAGS:016x}"
    return "\n".join(lines) + "\n"


def resource_text(state: KernelState, dev: Device) -> str:
    return _resource(dev.address, dev.class_code, _bar0_mib(state, dev))


def uevent_text(dev: PciIds) -> str:
    head = f"DRIVER={dev.driver}\n" if dev.driver else ""
    return (
        f"{head}PCI_CLASS={dev.class_code:X}\nPCI_ID={dev.vendor:04X}:{dev.device:04X}\n"
        f"PCI_SUBSYS_ID={dev.subsystem_vendor:04X}:{dev.subsystem_device:04X}\n"
        f"PCI_SLOT_NAME={dev.address}\nMODALIAS={modalias(dev)}\n"
    )


def _config(view: DeviceView) -> bytes:
    if view.bridge_buses is not None:
        port = configspace.PCIE_ROOT_PORT if view.on_root_bus else configspace.PCIE_DOWNSTREAM_PORT
    else:
        port = configspace.PCIE_ENDPOINT
    return configspace.build_config(
        vendor=view.vendor,
        device=view.device,
        class_code=view.class_code,
        revision=view.revision,
        subsystem_vendor=view.subsystem_vendor,
        subsystem_device=view.subsystem_device,
        multifunction=view.multifunction,
        pcie=view.pcie,
        port_type=port,
        bridge_buses=view.bridge_buses,
        irq=view.irq,
        gpu=view.vendor == NVIDIA_VENDOR and view.class_code >> 16 == 0x03,
        bar0=_bar0(view.address, view.class_code, view.bar0_mib),
        sriov=(
            (view.sriov[0], view.sriov[4], view.sriov[1], view.sriov[2], view.sriov[3])
            if view.sriov
            else None
        ),
    )


def config_bytes(state: KernelState, dev: Device) -> bytes:
    return _config(_Context(state).view(dev))


# --- what each device's files depend on ---------------------------------------------------------------------


def _enable_count(state: KernelState, dev: Device) -> int:
    """``enable``: the device's ``enable_cnt``. Host drivers call ``pci_enable_device`` in probe (and disable
    in remove); vfio-pci only when a user opens the device (``vfio_pci_core_enable``). Seen on Linux 6.1:
    e1000e-bound 1, unbound 0, vfio-pci-bound and closed 0. The stubs' probe enables nothing."""
    count = dev.enable_cnt
    drv = state.drivers.get(dev.driver) if dev.driver else None
    if drv is not None and not drv.vfio and drv.name not in ("pci-stub", "pci-pf-stub"):
        count += 1
    return count + sum(1 for h in state.handles if h.kind == "vfio" and h.target == dev.address)


class DeviceView(NamedTuple):
    """Everything the files of one PCI function depend on: its own kernel state and what the rest of the state
    contributes to them (its path, its neighbours' paths, the driver model's verdicts).

    :func:`_render_device` reads nothing else, so equal views render the same files, and a device whose view
    did not change keeps its fragment (see :func:`render`). A fact a device's files show that is not in here
    would make a stale cache: add it here, never read the state from the renderer.
    """

    address: str
    path: str
    vendor: int
    device: int
    subsystem_vendor: int
    subsystem_device: int
    class_code: int
    revision: int
    irq: int
    numa_node: int
    pcie: bool
    driver: str | None
    driver_override: str | None
    enable_cnt: int
    is_vf: bool
    on_root_bus: bool  # a bridge on the root bus is a root port, else a downstream port
    multifunction: bool
    bridge_buses: tuple[int, int, int] | None  # bridges only
    bar0_mib: int  # of its GPU model; 1 for other functions
    iommu_group: int | None  # None without an IOMMU too
    consumers: tuple[tuple[str, str], ...]  # (address, path) of each present consumer
    # PF with the capability: total, offset, stride, VF device, numvfs, drivers_autoprobe
    sriov: tuple[int, int, int, int, int, bool] | None
    virtfns: tuple[tuple[int | None, str], ...]  # (index, path) of the PF's present VFs
    physfn_path: str | None
    vfio_index: int | None
    mdev_types: tuple[tuple[VgpuTypeSpec, int], ...] | None  # mdev parent: (type, available instances)
    vendor_vgpu: tuple[str, int] | None  # vGPU 17+ VF: (creatable_vgpu_types text, current type)


class _Context:
    """Per-render indexes over the state (paths, siblings, VFs, bridge ranges), so building every device's
    view stays linear in the number of devices."""

    def __init__(self, state: KernelState) -> None:
        self.state = state
        self.present = state.present_devices()
        self._paths: dict[str, str] = {}
        self._functions = Counter(d.address[:-1] for d in self.present if not d.is_vf)
        self._children = pci.child_index(state)
        self._vfs: dict[str, list[Device]] = {}
        for dev in state.devices.values():
            if dev.physfn is not None and dev.present:
                self._vfs.setdefault(dev.physfn, []).append(dev)
        for vfs in self._vfs.values():
            vfs.sort(key=lambda d: d.vf_index or 0)

    def path(self, dev: Device) -> str:
        path = self._paths.get(dev.address)
        if path is None:
            if dev.parent is None:
                addr = parse_address(dev.address)
                path = f"sys/devices/pci{addr.domain:04x}:{addr.bus:02x}/{dev.address}"
            else:
                path = f"{self.path(self.state.devices[dev.parent])}/{dev.address}"
            self._paths[dev.address] = path
        return path

    def vfs_of(self, pf: str) -> list[Device]:
        return self._vfs.get(pf, [])

    def view(self, dev: Device) -> DeviceView:
        state = self.state
        is_bridge = dev.is_bridge
        others = self._functions[dev.address[:-1]] - (0 if dev.is_vf else 1)
        consumers = tuple(
            (c, self.path(other)) for c in dev.consumers if (other := state.present(c)) is not None
        )
        sriov = None
        virtfns: tuple[tuple[int | None, str], ...] = ()
        if dev.sriov_total_vfs and not dev.is_vf:
            sriov = (
                dev.sriov_total_vfs,
                dev.sriov_offset,
                dev.sriov_stride,
                dev.sriov_vf_device or dev.device,
                dev.sriov_numvfs,
                dev.sriov_drivers_autoprobe,
            )
            virtfns = tuple((vf.vf_index, self.path(vf)) for vf in self.vfs_of(dev.address))
        mdev_types = None
        vendor_vgpu = None
        if dev.driver == nvidia.NVIDIA_DRIVER:
            if nvidia.is_mdev_parent(state, dev):
                model = state.model_of(dev)
                assert model is not None  # is_mdev_parent checked it
                mdev_types = tuple((t, nvidia.available_instances(state, dev, t)) for t in model.vgpu_types)
            if nvidia.is_vendor_vf(state, dev):
                assert dev.physfn is not None  # a VF
                siblings = self.vfs_of(dev.physfn)
                vendor_vgpu = (nvidia.creatable_text(state, dev, siblings), dev.vgpu_type)
        return DeviceView(
            address=dev.address,
            path=self.path(dev),
            vendor=dev.vendor,
            device=dev.device,
            subsystem_vendor=dev.subsystem_vendor,
            subsystem_device=dev.subsystem_device,
            class_code=dev.class_code,
            revision=dev.revision,
            irq=dev.irq,
            numa_node=dev.numa_node,
            pcie=dev.pcie,
            driver=dev.driver,
            driver_override=dev.driver_override,
            enable_cnt=_enable_count(state, dev),
            is_vf=dev.is_vf,
            on_root_bus=dev.parent is None,
            multifunction=parse_address(dev.address).function == 0 and others > 0,
            bridge_buses=pci.bridge_buses(state, dev, self._children) if is_bridge else None,
            bar0_mib=1 if is_bridge else _bar0_mib(state, dev),
            iommu_group=dev.iommu_group if state.iommu else None,
            consumers=consumers,
            sriov=sriov,
            virtfns=virtfns,
            physfn_path=self.path(state.devices[dev.physfn]) if dev.physfn is not None else None,
            vfio_index=dev.vfio_index,
            mdev_types=mdev_types,
            vendor_vgpu=vendor_vgpu,
        )


# --- render -------------------------------------------------------------------------------------------------


def render(state: KernelState) -> Tree:
    """Every kernel node of ``state``. Device fragments come from the memo when their view is unchanged."""
    ctx = _Context(state)
    return _merge(_fragments(state, ctx))


def _fragments(state: KernelState, ctx: _Context) -> Iterator[_Fragment]:
    tree = Tree()
    _render_bus(tree, state)
    yield _Fragment.of(tree)
    memo = _DEVICE_MEMO if _Caching.enabled else None
    for dev in ctx.present:
        view = ctx.view(dev)
        frag = memo.get(view) if memo is not None else None
        if frag is None:
            tree = Tree()
            _render_device(tree, view)
            frag = _Fragment.of(tree)
            if memo is not None:
                if len(memo) >= MEMO_LIMIT:
                    memo.clear()
                memo[view] = frag
        yield frag
    tree = Tree()
    for uuid, mdev in sorted(state.mdevs.items()):
        _render_mdev(tree, ctx, uuid, mdev.parent, mdev.type_id, mdev.iommu_group)
    _render_modules(tree, state)
    _render_proc(tree, state, ctx)
    _render_dev(tree, state, ctx)
    yield _Fragment.of(tree)


def _render_bus(tree: Tree, state: KernelState) -> None:
    bus = "sys/bus/pci"
    tree.file(f"{bus}/drivers_probe", "", 0o200, ("bus", "drivers_probe"))
    tree.file(
        f"{bus}/drivers_autoprobe", f"{int(state.bus_autoprobe)}\n", 0o644, ("bus", "drivers_autoprobe")
    )
    tree.file(f"{bus}/rescan", "", 0o200, ("bus", "rescan"))
    tree.file(f"{bus}/uevent", "", 0o200)
    tree.dir(f"{bus}/devices")
    tree.dir(f"{bus}/slots")
    tree.dir("sys/kernel/iommu_groups")
    tree.dir("sys/module")
    for drv in state.drivers.values():
        path = driver_path(drv.name)
        for attr in ("bind", "unbind", "new_id", "remove_id"):
            tree.file(f"{path}/{attr}", "", 0o200, ("driver", drv.name, attr))
        tree.file(f"{path}/uevent", "", 0o200)
        if drv.module:
            tree.link(f"{path}/module", f"sys/module/{drv.module}")
    if state.module("mdev"):
        tree.dir("sys/bus/mdev/devices")
        tree.dir("sys/class/mdev_bus")
        if state.module(nvidia.VGPU_VFIO_MODULE):
            tree.dir(f"sys/bus/mdev/drivers/{MDEV_DRIVER}")


def _render_device(tree: Tree, dev: DeviceView) -> None:
    path = dev.path
    addr = dev.address
    is_bridge = (dev.class_code >> 8) == 0x0604
    tree.link(f"sys/bus/pci/devices/{addr}", path)
    hexes = {
        "vendor": f"0x{dev.vendor:04x}\n",
        "device": f"0x{dev.device:04x}\n",
        "subsystem_vendor": f"0x{dev.subsystem_vendor:04x}\n",
        "subsystem_device": f"0x{dev.subsystem_device:04x}\n",
        "class": f"0x{dev.class_code:06x}\n",
        "revision": f"0x{dev.revision:02x}\n",
        "modalias": modalias(dev) + "\n",
        "irq": f"{dev.irq}\n",
        "local_cpus": cpumask(dev.numa_node) + "\n",
        "local_cpulist": cpulist(dev.numa_node) + "\n",
        "resource": _resource(addr, dev.class_code, dev.bar0_mib),
        "power_state": "D0\n",
        "dma_mask_bits": "64\n",
        "consistent_dma_mask_bits": "64\n",
        "ari_enabled": "0\n",
    }
    for name, text in hexes.items():
        tree.file(f"{path}/{name}", text)
    rw = {
        "numa_node": f"{dev.numa_node}\n",
        "driver_override": f"{dev.driver_override if dev.driver_override is not None else '(null)'}\n",
        "enable": f"{dev.enable_cnt}\n",
    }
    for name, text in rw.items():
        tree.file(f"{path}/{name}", text, 0o644, ("device", addr, name))
    for name, text in (("d3cold_allowed", "1\n"), ("msi_bus", "1\n"), ("broken_parity_status", "0\n")):
        tree.file(f"{path}/{name}", text, 0o644)
    tree.file(f"{path}/uevent", uevent_text(dev), 0o644)
    tree.file(f"{path}/config", _config(dev), 0o644)
    tree.file(f"{path}/power/control", "on\n", 0o644)
    tree.file(f"{path}/power/runtime_status", "active\n")
    if dev.class_code >> 8 == CLASS_VGA >> 8:
        tree.file(f"{path}/boot_vga", "0\n" if dev.vendor == NVIDIA_VENDOR else "1\n")
    if not dev.is_vf:
        tree.file(f"{path}/remove", "", 0o200, ("device", addr, "remove"))
        tree.file(f"{path}/rescan", "", 0o200, ("device", addr, "rescan"))
    if not is_bridge:
        tree.file(f"{path}/reset", "", 0o200, ("device", addr, "reset"))
    if dev.pcie:
        for name, text in (
            ("current_link_speed", configspace.LINK_SPEED_GTS[4]),
            ("max_link_speed", configspace.LINK_SPEED_GTS[4]),
            ("current_link_width", "16"),
            ("max_link_width", "16"),
        ):
            tree.file(f"{path}/{name}", text + "\n")
    tree.link(f"{path}/subsystem", "sys/bus/pci")
    if dev.driver:
        tree.link(f"{path}/driver", driver_path(dev.driver))
        tree.link(f"{driver_path(dev.driver)}/{addr}", path)
    if dev.iommu_group is not None:
        group = f"sys/kernel/iommu_groups/{dev.iommu_group}"
        tree.link(f"{path}/iommu_group", group)
        tree.link(f"{group}/devices/{addr}", path)
        tree.file(f"{group}/type", "DMA-FQ\n", 0o644)
        tree.file(f"{group}/reserved_regions", "0x00000000fee00000 0x00000000feefffff msi\n")
    for consumer, consumer_path in dev.consumers:
        link = f"sys/devices/virtual/devlink/pci:{addr}--pci:{consumer}"
        tree.link(f"{path}/consumer:pci:{consumer}", link)
        tree.link(f"{consumer_path}/supplier:pci:{addr}", link)
        tree.link(f"{link}/supplier", path)
        tree.link(f"{link}/consumer", consumer_path)
        tree.file(f"{link}/status", "active\n")
        tree.file(f"{link}/sync_state_only", "0\n")
    if dev.sriov is not None:
        _render_sriov(tree, dev, dev.sriov)
    if dev.physfn_path is not None:
        tree.link(f"{path}/physfn", dev.physfn_path)
    if dev.vfio_index is not None:
        tree.file(f"{path}/vfio-dev/vfio{dev.vfio_index}/dev", f"511:{dev.vfio_index}\n")
    if dev.mdev_types is not None:
        _render_mdev_types(tree, dev, dev.mdev_types)
    if dev.vendor_vgpu is not None:
        creatable, current = dev.vendor_vgpu
        tree.file(f"{path}/nvidia/creatable_vgpu_types", creatable)
        tree.file(f"{path}/nvidia/current_vgpu_type", f"{current}\n", 0o644, ("vgpu_type", addr))


def _render_sriov(tree: Tree, dev: DeviceView, sriov: tuple[int, int, int, int, int, bool]) -> None:
    addr, path = dev.address, dev.path
    total, offset, stride, vf_device, numvfs, autoprobe = sriov
    for name, text in (
        ("sriov_totalvfs", f"{total}\n"),
        ("sriov_offset", f"{offset}\n"),
        ("sriov_stride", f"{stride}\n"),
        ("sriov_vf_device", f"{vf_device:x}\n"),
        ("sriov_vf_total_msix", "0\n"),
    ):
        tree.file(f"{path}/{name}", text)
    tree.file(f"{path}/sriov_numvfs", f"{numvfs}\n", 0o664, ("device", addr, "sriov_numvfs"))
    tree.file(
        f"{path}/sriov_drivers_autoprobe",
        f"{int(autoprobe)}\n",
        0o644,
        ("device", addr, "sriov_drivers_autoprobe"),
    )
    for index, vf_path in dev.virtfns:
        tree.link(f"{path}/virtfn{index}", vf_path)


def _render_mdev_types(tree: Tree, dev: DeviceView, types: tuple[tuple[VgpuTypeSpec, int], ...]) -> None:
    path = dev.path
    tree.link(f"sys/class/mdev_bus/{dev.address}", path)
    for vtype, available in types:
        tdir = f"{path}/mdev_supported_types/nvidia-{vtype.type_id}"
        description = (
            f"num_heads={vtype.heads}, frl_config={vtype.frl_config}, framebuffer={vtype.framebuffer_mib}M, "
            f"max_resolution={vtype.max_resolution}, max_instance={vtype.max_instances}"
        )
        tree.file(f"{tdir}/name", f"{vtype.name}\n")
        tree.file(f"{tdir}/description", f"{description}\n")
        tree.file(f"{tdir}/device_api", "vfio-pci\n")
        tree.file(f"{tdir}/available_instances", f"{available}\n")
        tree.file(f"{tdir}/create", "", 0o200, ("mdev_type", dev.address, str(vtype.type_id)))
        tree.dir(f"{tdir}/devices")


def _render_mdev(tree: Tree, ctx: _Context, uuid: str, parent: str, type_id: int, group: int) -> None:
    parent_path = ctx.path(ctx.state.devices[parent])
    path = f"{parent_path}/{uuid}"
    type_dir = f"{parent_path}/mdev_supported_types/nvidia-{type_id}"
    tree.file(f"{path}/remove", "", 0o200, ("mdev", uuid))
    tree.file(f"{path}/uevent", f"MDEV_TYPE=nvidia-{type_id}\nDRIVER={MDEV_DRIVER}\n", 0o644)
    tree.link(f"{path}/mdev_type", type_dir)
    tree.link(f"{path}/subsystem", "sys/bus/mdev")
    tree.link(f"{path}/driver", f"sys/bus/mdev/drivers/{MDEV_DRIVER}")
    tree.link(f"{path}/iommu_group", f"sys/kernel/iommu_groups/{group}")
    tree.link(f"sys/kernel/iommu_groups/{group}/devices/{uuid}", path)
    tree.file(f"sys/kernel/iommu_groups/{group}/type", "DMA-FQ\n", 0o644)
    tree.link(f"{type_dir}/devices/{uuid}", path)
    tree.link(f"sys/bus/mdev/devices/{uuid}", path)
    tree.link(f"sys/bus/mdev/drivers/{MDEV_DRIVER}/{uuid}", path)


def _taint(license_: str, build: str) -> str:
    """Out-of-tree (O) unsigned (E) modules, proprietary (P) unless GPL-compatible."""
    if not build:
        return ""
    return "POE" if license_ == "NVIDIA" else "OE"


def _render_modules(tree: Tree, state: KernelState) -> None:
    lines = []
    references = handles.module_references(state)
    for mod in reversed(state.modules):  # /proc/modules lists the newest first
        holders = state.holders_of(mod.name)
        refcnt = len(holders) + references[mod.name]  # handles.refcount, with the references counted once
        taint = _taint(mod.license, mod.build)
        users = "".join(f"{h}," for h in holders) or "-"
        lines.append(
            f"{mod.name} {mod.size} {refcnt} {users} Live 0x0000000000000000"
            + (f" ({taint})" if taint else "")
        )
        base = f"sys/module/{mod.name}"
        tree.file(f"{base}/refcnt", f"{refcnt}\n")
        tree.file(f"{base}/initstate", "live\n")
        tree.file(f"{base}/taint", f"{taint}\n")
        tree.file(f"{base}/coresize", f"{mod.size}\n")
        tree.file(f"{base}/uevent", "", 0o200)
        if mod.version:
            tree.file(f"{base}/version", f"{mod.version}\n")
        tree.dir(f"{base}/holders")
        for holder in holders:
            tree.link(f"{base}/holders/{holder}", f"sys/module/{holder}")
        for drv in mod.drivers:
            if drv in state.drivers:
                tree.link(f"{base}/drivers/pci:{drv}", driver_path(drv))
    tree.file("proc/modules", "".join(line + "\n" for line in lines))


def _render_proc(tree: Tree, state: KernelState, ctx: _Context) -> None:
    tree.file("proc/cmdline", state.cmdline + "\n")
    tree.file("proc/sys/kernel/hostname", state.hostname + "\n", 0o644)
    tree.file("proc/sys/kernel/osrelease", state.kernel_release + "\n")
    tree.file(
        "proc/version",
        f"Linux version {state.kernel_release} (buildd@lcy02-amd64-001) (x86_64-linux-gnu-gcc-12 (Ubuntu "
        "12.3.0-1ubuntu1~22.04) 12.3.0, GNU ld (GNU Binutils for Ubuntu) 2.38) #45~22.04.1-Ubuntu SMP\n",
    )
    _render_holders(tree, state, ctx)
    core = state.module("nvidia")
    if core is None:
        return
    tree.file("proc/driver/nvidia/version", nvidia.version_text(core.version, core.build))
    tree.file("proc/driver/nvidia/params", nvidia.params_text())
    tree.dir("proc/driver/nvidia/gpus")
    for minor, dev in enumerate(d for d in ctx.present if d.driver == nvidia.NVIDIA_DRIVER):
        base = f"proc/driver/nvidia/gpus/{dev.address}"
        tree.file(f"{base}/information", nvidia.information_text(state, dev, minor))
        tree.file(f"{base}/unbindLock", f"{int(dev.unbind_lock)}\n", 0o644, ("unbind_lock", dev.address))


def holder_pid(holder: str) -> int:
    """A stable process id per holder, so a holder keeps its pid while other holders come and go."""
    return 1000 + zlib.crc32(holder.encode()) % 60000


def _render_holders(tree: Tree, state: KernelState, ctx: _Context) -> None:
    """``proc/<pid>/{comm,cmdline,fd/N}`` of each process holding a device, as ``fuser`` reads them: a VM is
    a ``qemu-system-x86`` with libvirt's ``-name guest=<vm>``, a daemon is named after its unit."""
    minors = {d.address: n for n, d in enumerate(d for d in ctx.present if d.driver == nvidia.NVIDIA_DRIVER)}
    by_holder: dict[str, list[str]] = {}
    for h in state.handles:
        if h.kind == "nvidia":
            target = f"/dev/nvidia{minors.get(h.target, 0)}"
        elif h.kind == "mdev":
            mdev = state.mdevs.get(h.target)
            target = f"/dev/vfio/{mdev.iommu_group}" if mdev else "/dev/vfio/vfio"
        else:
            dev = state.devices.get(h.target)
            target = (
                f"/dev/vfio/{dev.iommu_group}" if dev and dev.iommu_group is not None else "/dev/vfio/vfio"
            )
        by_holder.setdefault(h.holder, []).append(target)
    for holder, targets in by_holder.items():
        base = f"proc/{holder_pid(holder)}"
        if holder.startswith("qemu:"):
            comm, cmdline = (
                "qemu-system-x86",
                f"qemu-system-x86_64\0-name\0guest={holder[5:]},debug-threads=on\0",
            )
        else:
            comm = holder.removesuffix(".service")[:15]
            cmdline = holder.removesuffix(".service") + "\0"
        tree.file(f"{base}/comm", comm + "\n")
        tree.file(f"{base}/cmdline", cmdline)
        tree.dir(f"{base}/fd")
        for fd, target in enumerate(dict.fromkeys(targets), start=3):
            tree.absolute_link(f"{base}/fd/{fd}", target)


def _render_dev(tree: Tree, state: KernelState, ctx: _Context) -> None:
    if state.module("vfio"):
        tree.file("dev/vfio/vfio", "", 0o666)
    groups = set()
    for dev in ctx.present:
        if dev.vfio_index is not None:
            tree.file(f"dev/vfio/devices/vfio{dev.vfio_index}", "", 0o600)
            if dev.iommu_group is not None:
                groups.add(dev.iommu_group)
    groups |= {m.iommu_group for m in state.mdevs.values()}
    for group in groups:
        tree.file(f"dev/vfio/{group}", "", 0o600)
    if state.module("nvidia"):
        tree.file("dev/nvidiactl", "", 0o666)
        bound = [d for d in ctx.present if d.driver == nvidia.NVIDIA_DRIVER and not d.is_vf]
        for minor, _dev in enumerate(bound):
            tree.file(f"dev/nvidia{minor}", "", 0o666)
    if state.module("nvidia_uvm"):
        tree.file("dev/nvidia-uvm", "", 0o666)


# --- apply --------------------------------------------------------------------------------------------------


def changes(old: Tree, new: Tree) -> tuple[list[str], list[str]]:
    """(paths to remove, paths to create or rewrite) to go from ``old`` to ``new``; a node that changed kind
    is in both.

    Only paths of the fragments the two trees do not share can differ: a path whose every fragment is
    shared merges to the same node in both (fragments keep their relative order). Unchanged nodes of
    re-rendered fragments are skipped by value.
    """
    old_nodes, new_nodes = old.nodes, new.nodes
    paths: Iterable[str]
    if old.parts and new.parts:
        shared = {id(f) for f in old.parts} & {id(f) for f in new.parts}
        candidates: dict[str, None] = {}
        for frag in (*old.parts, *new.parts):
            if id(frag) not in shared:
                candidates.update(dict.fromkeys(frag.dirs))
                candidates.update(dict.fromkeys(frag.items))
        paths = candidates
    else:
        paths = {**old_nodes, **new_nodes}
    gone: list[str] = []
    made: list[str] = []
    for path in paths:
        before, node = old_nodes.get(path), new_nodes.get(path)
        if before is node:
            continue
        if node is None:
            gone.append(path)
            continue
        if before is not None:
            if before == node:
                continue
            if type(before) is not type(node):
                gone.append(path)
        made.append(path)
    return gone, made


def apply(root: Path, old: Tree, new: Tree) -> None:
    """Make the disk go from ``old`` to ``new``: remove what went or changed kind, then create and update.

    Every step is idempotent (missing files are fine, existing directories too), so replaying the same
    ``old → new`` after an interrupted apply finishes it (see the kernel's transaction)."""
    base = os.fspath(root)
    gone, made = changes(old, new)
    for path in sorted(gone, key=lambda p: p.count("/"), reverse=True):
        target = f"{base}/{path}"
        if isinstance(old.nodes[path], Dir):
            # gone already, or something outside the kernel's tree lives there: leave it
            with contextlib.suppress(OSError):
                os.rmdir(target)
        else:
            _unlink(target)
    umask = _umask() if made else 0
    for path in sorted(made, key=lambda p: p.count("/")):
        node = new.nodes[path]
        target = f"{base}/{path}"
        if isinstance(node, Dir):
            try:
                os.mkdir(target)
            except FileExistsError:
                if not os.path.isdir(target):
                    raise
        elif isinstance(node, Link):
            try:
                os.symlink(node.target, target)
            except FileExistsError:
                os.unlink(target)
                os.symlink(node.target, target)
        else:
            assert isinstance(node, File)
            _write_file(target, node, umask)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _umask() -> int:
    """The process umask, read without setting it (``os.umask`` would race with other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o777  # unknown: every mode gets an explicit chmod


def _write_file(path: str, node: File, umask: int) -> None:
    """A fresh file with exactly ``node.mode``; whatever was at ``path`` is replaced, never written through
    (it could be a symlink). Creating files is what a whole-tree apply spends its time on, so: one open that
    usually succeeds (the descriptor of a file it creates is writable whatever the mode), no write for the
    many empty attributes, a chmod only where the umask takes bits away."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, node.mode)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, flags, node.mode)
    try:
        view = memoryview(node.data)
        while view:
            view = view[os.write(fd, view) :]
        if node.mode & umask:
            os.fchmod(fd, node.mode)
    finally:
        os.close(fd)
