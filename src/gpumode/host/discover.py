"""Hardware discovery: the host's sysfs and procfs → one :class:`~gpumode.domain.HostSnapshot`.

Reads files exactly as a real kernel lays them out (``sys/bus/pci/devices/<BDF>/...``), so it neither knows
nor cares whether the root is a real machine or an emulated tree. It never writes and never raises on odd
content: every missing file, unreadable value or dangling link becomes a short message in
``snapshot.problems`` naming the path, and discovery carries on with what it could read.

Speed matters (the agent runs this on every report, the CLI on every call): each device directory is listed
once and only the files that listing shows are opened, each with one ``read(2)``; links are checked against
directory listings taken once, not with a ``stat`` per link.
"""

from __future__ import annotations

import os
import re

from gpumode.domain import (
    CLASS_NVSWITCH,
    NVIDIA_VENDOR,
    U16_MAX,
    Flavour,
    Gpu,
    HostSnapshot,
    Mdev,
    MdevType,
    PciAddress,
    PciAddressError,
    PciFunction,
    Sriov,
    SriovLayoutError,
    VendorVgpu,
    vf_addresses,
)
from gpumode.host.drivers import gpu_mode, host_driver_state, read_driver_facts
from gpumode.host.pciids import PciIds
from gpumode.host.pciids import default as default_ids
from gpumode.host.root import Host

PCI_DEVICES = "sys/bus/pci/devices"
UNREADABLE_ID = -1  # an id/class/revision file that is missing or garbage (the problem list says which)

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_VIRTFN = re.compile(r"^virtfn(\d+)$")
_CREATABLE_LINE = re.compile(r"^\s*(\d+)\s*:\s*(.*?)\s*$")
_VFIO_DRIVERS = frozenset({"vfio-pci", "nvgrace_gpu_vfio_pci"})


class SysReader:
    """The three filesystem operations discovery uses. Subclass to observe them (``bench/discover.py`` records
    them to time a bare loop over the very same files)."""

    def read(self, path: str) -> str | None:
        """A file's text; ``None`` if it does not exist. Other errors (EACCES, EIO, EISDIR) raise OSError."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            # sysfs attributes are at most one page and come back whole from a single read(2).
            return os.read(fd, 65536).decode("utf-8", "replace")
        finally:
            os.close(fd)

    def readlink(self, path: str) -> str:
        return os.readlink(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)


class _Scan:
    """State of one discovery run: the root, where to read, what went wrong."""

    def __init__(self, host: Host, reader: SysReader, ids: PciIds) -> None:
        self.root = str(host.root).rstrip("/") or ""
        self.reader = reader
        self.ids = ids
        self.problems: list[str] = []

    def rel(self, path: str) -> str:
        """``path`` relative to the root, for messages."""
        return path[len(self.root) + 1 :] if path.startswith(self.root + "/") else path

    def problem(self, path: str, what: str) -> None:
        self.problems.append(f"{self.rel(path)}: {what}")

    def read(self, path: str, *, required: bool = True) -> str | None:
        """Stripped text of a file, or ``None`` (missing → a problem when ``required``; unreadable → a
        problem)."""
        try:
            text = self.reader.read(path)
        except OSError as exc:
            self.problem(path, f"unreadable ({exc.strerror or exc})")
            return None
        if text is None:
            if required:
                self.problem(path, "missing")
            return None
        return text.strip()

    def listdir(self, path: str, *, required: bool = True) -> list[str] | None:
        try:
            return self.reader.listdir(path)
        except FileNotFoundError:
            if required:
                self.problem(path, "missing")
        except OSError as exc:
            self.problem(path, f"unreadable ({exc.strerror or exc})")
        return None

    def link_name(self, path: str) -> str | None:
        """Basename of a symlink's target (how the kernel names drivers, groups and devices), or ``None``."""
        try:
            target = self.reader.readlink(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.problem(path, f"not a readable link ({exc.strerror or exc})")
            return None
        name = target.rstrip("/").rsplit("/", 1)[-1]
        if not name or name in (".", ".."):
            self.problem(path, f"link to {target!r} names nothing")
            return None
        return name

    def number(self, path: str, text: str | None, base: int, default: int) -> int:
        """``text`` as an integer (``0x`` prefix optional in base 16), else ``default`` and a problem."""
        if text is None:
            return default
        try:
            return int(text, base)
        except ValueError:
            self.problem(path, f"unreadable value {text[:40]!r}")
            return default

    def address(self, path: str, name: str | None) -> str | None:
        """A PCI address as the kernel names it, normalized; garbage → ``None`` and a problem."""
        if name is None:
            return None
        try:
            return str(PciAddress.parse(name))
        except PciAddressError:
            self.problem(path, f"{name[:40]!r} is not a PCI address")
            return None


def discover(
    root: str | os.PathLike[str] | Host = "/",
    *,
    reader: SysReader | None = None,
    ids: PciIds | None = None,
) -> HostSnapshot:
    """Read the host under ``root`` and return its snapshot, fingerprint included."""
    host = root if isinstance(root, Host) else Host(root)
    scan = _Scan(host, reader or SysReader(), ids or default_ids())

    functions = _read_functions(scan)
    _check_links(scan, functions)
    _check_gpu_groups(scan, functions)

    bound = any(fn.driver == "nvidia" for fn in functions)
    facts = read_driver_facts(host, _vgpu_manager_traces(functions), nvidia_bound=bound)
    nvidia = facts.nvidia
    for fn in functions:
        if fn.vendor == NVIDIA_VENDOR and fn.class_code == UNREADABLE_ID and not fn.is_vf:
            scan.problem(f"{scan.root}/{PCI_DEVICES}/{fn.address}/class", "unreadable: not known to be a GPU")

    gpus = _gpus(functions, nvidia.flavour)
    nvswitches = [
        fn.address
        for fn in functions
        if fn.vendor == NVIDIA_VENDOR and fn.class_code & 0xFFFF00 == CLASS_NVSWITCH and not fn.is_vf
    ]
    if functions and all(fn.iommu_group is None for fn in functions):
        scan.problems.append(
            f"{PCI_DEVICES}: no function has an iommu_group link: the IOMMU is off (passthrough impossible)"
        )

    hostname = scan.read(f"{scan.root}/proc/sys/kernel/hostname", required=False)
    if not hostname:
        hostname = scan.read(f"{scan.root}/etc/hostname", required=False)
    if not hostname:
        scan.problems.append("proc/sys/kernel/hostname, etc/hostname: missing or empty; hostname unknown")
        hostname = ""
    kernel = scan.read(f"{scan.root}/proc/sys/kernel/osrelease") or None

    snapshot = HostSnapshot(
        hostname=hostname.splitlines()[0].strip() if hostname else "",
        kernel=kernel,
        functions=functions,
        gpus=gpus,
        nvswitches=nvswitches,
        modules=facts.modules,
        nvidia=nvidia,
        driver_state=host_driver_state(g.mode for g in gpus),
        problems=scan.problems + facts.problems,
    )
    snapshot.fingerprint = snapshot.compute_fingerprint()
    return snapshot


# --- PCI functions ----------------------------------------------------------------------------------------


def _read_functions(scan: _Scan) -> list[PciFunction]:
    base = f"{scan.root}/{PCI_DEVICES}"
    names = scan.listdir(base)
    if names is None:
        return []
    found: list[tuple[PciAddress, PciFunction]] = []
    for name in names:
        try:
            address = PciAddress.parse(name)
        except PciAddressError:
            scan.problem(f"{base}/{name}", "not a PCI address; ignored")
            continue
        fn = _read_function(scan, f"{base}/{name}", str(address))
        if fn is not None:
            found.append((address, fn))
    found.sort(key=lambda pair: pair[0])
    return [fn for _, fn in found]


def _read_function(scan: _Scan, dev: str, address: str) -> PciFunction | None:
    reported = len(scan.problems)
    entries = scan.listdir(dev)
    if entries is None:
        if not os.path.lexists(dev):
            del scan.problems[reported:]
            scan.problem(dev, "vanished while being read (hot-removed?); dropped")
        return None
    present = set(entries)

    def hex_attr(name: str) -> int:
        path = f"{dev}/{name}"
        return scan.number(path, scan.read(path), 16, UNREADABLE_ID)

    fn = PciFunction(
        address=address,
        vendor=hex_attr("vendor"),
        device=hex_attr("device"),
        subsystem_vendor=hex_attr("subsystem_vendor"),
        subsystem_device=hex_attr("subsystem_device"),
        class_code=hex_attr("class"),
        revision=hex_attr("revision"),
    )

    if "numa_node" in present:
        path = f"{dev}/numa_node"
        node = scan.number(path, scan.read(path), 10, -1)
        fn.numa_node = node if node >= 0 else None
    if "iommu_group" in present:
        path = f"{dev}/iommu_group"
        fn.iommu_group = scan.number(path, scan.link_name(path), 10, -1)
        if fn.iommu_group < 0:
            fn.iommu_group = None
    if "driver" in present:
        fn.driver = scan.link_name(f"{dev}/driver")
    if "boot_vga" in present:
        path = f"{dev}/boot_vga"
        flag = scan.number(path, scan.read(path), 10, -1)
        fn.boot_vga = flag == 1 if flag in (0, 1) else None
    if "driver_override" in present:
        override = scan.read(f"{dev}/driver_override")
        fn.driver_override = None if override in (None, "", "(null)") else override

    if "physfn" in present:
        path = f"{dev}/physfn"
        fn.physfn = scan.address(path, scan.link_name(path))
    if "sriov_totalvfs" in present:
        fn.sriov = _read_sriov(scan, dev, address, entries)
    if "mdev_supported_types" in present:
        fn.mdev_types = _read_mdev_types(scan, f"{dev}/mdev_supported_types")
    for entry in entries:
        if entry.startswith("consumer:"):
            kind, _, who = entry[len("consumer:") :].partition(":")
            if kind == "pci":
                consumer = scan.address(f"{dev}/{entry}", who)
                if consumer is not None:
                    fn.consumers.append(consumer)
        elif _UUID.match(entry):
            mdev = _read_mdev(scan, dev, entry, address)
            if mdev is not None:
                fn.mdevs.append(mdev)
    fn.consumers.sort()
    fn.mdevs.sort(key=lambda m: m.uuid)
    if "nvidia" in present:
        fn.vendor_vgpu = _read_vendor_vgpu(scan, f"{dev}/nvidia")

    if fn.vendor == UNREADABLE_ID and not os.path.lexists(dev):
        # removed between listing and reading: not a function with ids -1, a function that is gone
        del scan.problems[reported:]
        scan.problem(dev, "vanished while being read (hot-removed?); dropped")
        return None
    ids = scan.ids
    if fn.vendor >= 0:
        fn.vendor_name = ids.vendor(fn.vendor)
        if fn.device >= 0:
            fn.device_name = ids.device(fn.vendor, fn.device)
    if fn.class_code >= 0:
        fn.class_name = ids.class_name(fn.class_code)
    return fn


def _read_sriov(scan: _Scan, dev: str, address: str, entries: list[str]) -> Sriov:
    total_path, num_path = f"{dev}/sriov_totalvfs", f"{dev}/sriov_numvfs"
    present = set(entries)
    sriov = Sriov(
        total_vfs=scan.number(total_path, scan.read(total_path), 10, 0),
        num_vfs=scan.number(num_path, scan.read(num_path), 10, 0),
        offset=_read_u16(scan, dev, "sriov_offset", present),
        stride=_read_u16(scan, dev, "sriov_stride", present),
    )
    numbered: list[tuple[int, str]] = []
    for entry in entries:
        match = _VIRTFN.match(entry)
        if match:
            path = f"{dev}/{entry}"
            vf = scan.address(path, scan.link_name(path))
            if vf is not None:
                numbered.append((int(match.group(1)), vf))
    numbered.sort()
    sriov.vfs = [vf for _, vf in numbered]
    if len(sriov.vfs) != sriov.num_vfs:
        scan.problem(num_path, f"says {sriov.num_vfs} VFs but {len(sriov.vfs)} virtfn links exist")
    if sriov.offset is not None and sriov.stride is not None:
        _check_vf_layout(scan, dev, address, (sriov.offset, sriov.stride, sriov.total_vfs), numbered)
    return sriov


def _read_u16(scan: _Scan, dev: str, name: str, present: set[str]) -> int | None:
    """A decimal 16-bit SR-IOV field (``%u``); ``None`` and a problem when missing, unreadable or garbage."""
    path = f"{dev}/{name}"
    if name not in present:
        scan.problem(path, "missing")
        return None
    text = scan.read(path)
    if text is None:
        return None  # unreadable: the problem is listed
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if not 0 <= value <= U16_MAX:
        scan.problem(path, f"unreadable value {text[:40]!r} (expected a 16-bit count)")
        return None
    return value


def _check_vf_layout(
    scan: _Scan, dev: str, address: str, layout: tuple[int, int, int], numbered: list[tuple[int, str]]
) -> None:
    """The VFs must be where offset and stride say: the planner names VFs by those before they exist."""
    offset, stride, total = layout
    try:
        expected = vf_addresses(address, offset, stride, total)
    except SriovLayoutError as exc:
        scan.problem(f"{dev}/sriov_offset", exc.reason)
        return
    for index, vf in numbered:
        where = expected[index] if index < len(expected) else None
        if vf != where:
            scan.problem(
                f"{dev}/virtfn{index}",
                f"points at {vf}, but sriov_offset {offset} and sriov_stride {stride} put VF {index} at "
                f"{where or 'no address (past sriov_totalvfs)'}",
            )


def _read_mdev_types(scan: _Scan, base: str) -> list[MdevType]:
    types: list[MdevType] = []
    for type_id in sorted(scan.listdir(base) or []):
        tdir = f"{base}/{type_id}"
        entries = scan.listdir(tdir)
        if entries is None:
            continue
        present = set(entries)
        # name and description are optional in the mdev ABI; available_instances and device_api are not.
        name = scan.read(f"{tdir}/name") if "name" in present else None
        description = scan.read(f"{tdir}/description") if "description" in present else None
        avail_path = f"{tdir}/available_instances"
        available = scan.number(avail_path, scan.read(avail_path), 10, 0)
        device_api = scan.read(f"{tdir}/device_api") or ""
        types.append(MdevType(type_id, name or type_id, description or "", max(available, 0), device_api))
    return types


def _read_mdev(scan: _Scan, dev: str, uuid: str, parent: str) -> Mdev | None:
    path = f"{dev}/{uuid}/mdev_type"
    type_id = scan.link_name(path)
    if type_id is None:
        scan.problem(path, "missing: not an mdev, ignored")
        return None
    return Mdev(uuid, type_id, parent)


def _read_vendor_vgpu(scan: _Scan, base: str) -> VendorVgpu | None:
    entries = scan.listdir(base)
    if entries is None or ("creatable_vgpu_types" not in entries and "current_vgpu_type" not in entries):
        return None
    creatable: dict[int, str] = {}
    path = f"{base}/creatable_vgpu_types"
    text = scan.read(path)
    for line in (text or "").splitlines():
        if not line.strip() or line.lstrip().startswith("ID"):
            continue  # the "ID    : vGPU Name" header
        match = _CREATABLE_LINE.match(line)
        if match and match.group(2):
            creatable[int(match.group(1))] = match.group(2)
        else:
            scan.problem(path, f"unreadable line {line[:60]!r}")
    current_path = f"{base}/current_vgpu_type"
    current = scan.number(current_path, scan.read(current_path), 10, 0)
    return VendorVgpu(creatable, max(current, 0))


def _vgpu_manager_traces(functions: list[PciFunction]) -> list[str]:
    """What the PCI tree shows of the vGPU manager: the vendor interface on VFs, mdev types on nvidia."""
    traces = []
    vendor = [fn.address for fn in functions if fn.vendor_vgpu is not None]
    if vendor:
        traces.append(f"{PCI_DEVICES}/{vendor[0]}/nvidia: vGPU vendor interface on {len(vendor)} VF(s)")
    parents = [fn.address for fn in functions if fn.mdev_types and fn.driver == "nvidia"]
    if parents:
        where = f"{PCI_DEVICES}/{parents[0]}/mdev_supported_types"
        traces.append(f"{where}: vGPU types on {len(parents)} function(s)")
    return traces


def _check_links(scan: _Scan, functions: list[PciFunction]) -> None:
    """Report links whose target does not exist, checked against listings taken once rather than a stat
    each."""
    known = {fn.address for fn in functions}
    drivers = set(scan.listdir(f"{scan.root}/sys/bus/pci/drivers", required=False) or [])
    groups = set(scan.listdir(f"{scan.root}/sys/kernel/iommu_groups", required=False) or [])
    base = PCI_DEVICES

    def dangling(fn: PciFunction, link: str, target: str) -> None:
        scan.problems.append(f"{base}/{fn.address}/{link}: dangling link (no {target})")

    for fn in functions:
        if fn.driver is not None and fn.driver not in drivers:
            dangling(fn, "driver", f"sys/bus/pci/drivers/{fn.driver}")
        if fn.iommu_group is not None and str(fn.iommu_group) not in groups:
            dangling(fn, "iommu_group", f"sys/kernel/iommu_groups/{fn.iommu_group}")
        if fn.physfn is not None and fn.physfn not in known:
            dangling(fn, "physfn", f"function {fn.physfn}")
        for vf in fn.sriov.vfs if fn.sriov else []:
            if vf not in known:
                dangling(fn, "virtfn*", f"function {vf}")
        for consumer in fn.consumers:
            if consumer not in known:
                dangling(fn, f"consumer:pci:{consumer}", f"function {consumer}")
        type_ids = {t.type_id for t in fn.mdev_types}
        for mdev in fn.mdevs:
            if mdev.type_id not in type_ids:
                dangling(fn, f"{mdev.uuid}/mdev_type", f"mdev_supported_types/{mdev.type_id}")


def _check_gpu_groups(scan: _Scan, functions: list[PciFunction]) -> None:
    """A GPU's IOMMU group must hold only functions the host lists: a member that sys/bus/pci/devices does
    not show (removed, or vanished mid-read) makes the group partial, and passthrough of it cannot work."""
    known = {fn.address for fn in functions}
    for fn in functions:
        if not fn.is_nvidia_gpu or fn.iommu_group is None:
            continue
        group = fn.iommu_group
        members = scan.listdir(f"{scan.root}/sys/kernel/iommu_groups/{group}/devices", required=False)
        for name in sorted(members or []):
            if name not in known:
                scan.problems.append(
                    f"{PCI_DEVICES}/{fn.address}/iommu_group: group {group} also holds {name}, which "
                    f"{PCI_DEVICES} does not list (a partial group)"
                )


# --- GPUs -------------------------------------------------------------------------------------------------


def _gpus(functions: list[PciFunction], flavour: Flavour | None) -> list[Gpu]:
    by_address = {fn.address: fn for fn in functions}
    groups: dict[int, list[str]] = {}
    for fn in functions:
        if fn.iommu_group is not None:
            groups.setdefault(fn.iommu_group, []).append(fn.address)

    gpus: list[Gpu] = []
    for fn in functions:
        if not fn.is_nvidia_gpu:  # NVIDIA VGA/3D controller, any prog-if, never a VF
            continue
        companions = set(groups.get(fn.iommu_group, [])) if fn.iommu_group is not None else set()
        companions.update(fn.consumers)
        companions.discard(fn.address)
        vfs = list(fn.sriov.vfs) if fn.sriov else []
        vf_fns = [by_address[vf] for vf in vfs if vf in by_address]
        mdevs = [m.uuid for m in fn.mdevs] + [m.uuid for vf in vf_fns for m in vf.mdevs]
        vgpus = [vf.address for vf in vf_fns if vf.vendor_vgpu is not None and vf.vendor_vgpu.current]
        gpus.append(
            Gpu(
                address=fn.address,
                device=fn.device,
                name=fn.device_name or f"NVIDIA device {fn.device:04x}",
                numa_node=fn.numa_node,
                iommu_group=fn.iommu_group,
                driver=fn.driver,
                mode=gpu_mode(fn.driver, flavour),
                companions=sorted(companions, key=PciAddress.parse),
                vfs=vfs,
                mdevs=sorted(mdevs),
                vgpus=vgpus,
            )
        )
    return gpus


__all__ = ["PCI_DEVICES", "SysReader", "discover"]
