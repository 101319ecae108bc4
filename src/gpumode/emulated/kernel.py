"""The emulated kernel: the one object that changes an emulated host's kernel state.

``EmulatedKernel(root)`` is cheap and stateless; every call locks the host, loads ``state.json``, acts, saves
and updates the files that changed (see :mod:`gpumode.emulated.state` and :mod:`.sysfs`). A call that
fails raises the ``OSError`` a real kernel would (errno included) and changes nothing.

Public API (stable; the userspace half and the hypervisor build on it):

* :meth:`EmulatedKernel.write` — ``write(2)`` to a sysfs/procfs file (what
  :meth:`gpumode.host.root.Host.write` calls on an emulated host).
* :meth:`~EmulatedKernel.load_module` / :meth:`~EmulatedKernel.unload_module` — ``modprobe`` (dependencies
  first) and ``rmmod``; :meth:`~EmulatedKernel.loaded_modules`, :meth:`~EmulatedKernel.module_refcount`,
  :meth:`~EmulatedKernel.matching_modules` (udev's modalias lookup).
* :meth:`~EmulatedKernel.open_handle` / :meth:`~EmulatedKernel.close_handle` /
  :meth:`~EmulatedKernel.close_all` — ``/dev/nvidia*`` clients and VMs holding VFIO devices or mdevs.
* :meth:`~EmulatedKernel.iommu_group_viable`, :meth:`~EmulatedKernel.snapshot` — read-only questions.
* :meth:`~EmulatedKernel.inject_fault` — make the next operation on a path or module fail (tests).
* :meth:`~EmulatedKernel.reboot` — power-cycle: hardware cold, no modules, no VFs, no vGPUs, no handles.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpumode.emulated import drivers, handles, modules, nvidia, pci, sysfs
from gpumode.emulated import state as state_mod
from gpumode.emulated.errors import kernel_error, kstrtol, kstrtoul
from gpumode.emulated.state import Device, Fault, Handle, HandleKind, KernelState

PAGE_SIZE = 4096


@dataclass(slots=True)
class _Txn:
    state: KernelState
    tree: sysfs.Tree


class EmulatedKernel:
    """The kernel of the emulated host rooted at ``root`` (a directory holding ``.gpumode-emulated/``)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"EmulatedKernel({str(self.root)!r})"

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[_Txn]:
        with state_mod.locked(self.root):
            text = state_mod.read_text(self.root)
            current = state_mod.parse(text)
            tree = _finish_interrupted(self.root, text, current)
            txn = _Txn(current, tree if tree is not None else _tree_of(text, current))
            yield txn  # an exception here skips the save: nothing changed
            new_text = state_mod.dumps(txn.state)
            if new_text == text:  # nothing changed (a no-op write): no save, no file touched
                return
            new_tree = sysfs.render(txn.state)
            state_mod.commit(self.root, new_text)
            sysfs.apply(self.root, txn.tree, new_tree)
            state_mod.done(self.root)
            _remember(new_text, new_tree)

    # --- writes ---------------------------------------------------------------------------------------------

    def write(self, relpath: str, value: str) -> None:
        """Write ``value`` to the kernel file ``relpath`` (relative to the root; symlinks resolved like
        sysfs).

        Raises ``FileNotFoundError`` (ENOENT) for a missing path, ``PermissionError`` (EACCES) for a file that
        is not writable, ``IsADirectoryError`` for a directory, and the attribute's own errno otherwise.
        """
        fault: OSError | None = None
        with self._transaction() as txn:
            rel = self._resolve(relpath)
            fault = _take_fault(txn.state, rel)
            if fault is None:
                action = txn.tree.writable.get(rel)
                if action is None:
                    if isinstance(txn.tree.nodes.get(rel), sysfs.Dir) or (self.root / rel).is_dir():
                        raise kernel_error(errno.EISDIR, "is a directory", relpath)
                    raise kernel_error(errno.EACCES, "read-only attribute", relpath)
                try:
                    _dispatch(txn.state, action, value)
                except OSError as exc:
                    if exc.filename is None:
                        exc.filename = relpath
                    raise
        if fault is not None:
            raise fault

    def _resolve(self, relpath: str) -> str:
        root_real = os.path.realpath(self.root)
        full = os.path.realpath(os.path.join(root_real, relpath.lstrip("/")))
        if full != root_real and not full.startswith(root_real + os.sep):
            raise kernel_error(errno.EACCES, "outside the emulated host", relpath)
        if not os.path.lexists(full):
            raise kernel_error(errno.ENOENT, "no such kernel file", relpath)
        return os.path.relpath(full, root_real)

    # --- modules --------------------------------------------------------------------------------------------

    def load_module(self, name: str) -> list[str]:
        """``modprobe name``: load its dependencies first, then it; returns the modules newly loaded, in
        order.

        Unknown module → ENOENT; a module of the other ``nvidia`` flavour than the loaded ``nvidia`` → ENOENT
        ("Unknown symbol in module"), because there is only one ``nvidia``. Loading registers the module's PCI
        drivers and autoprobes every unbound matching device. Already loaded → ``[]``.
        """
        loaded: list[str] = []
        with self._transaction() as txn:
            fault = _take_fault(txn.state, f"load:{name}")
            if fault is None:
                loaded = load_modules(self.root, txn.state, name)
        if fault is not None:
            raise fault
        return loaded

    def unload_module(self, name: str) -> None:
        """``rmmod name``: not loaded → ENOENT; in use (holders or open handles) → EBUSY; otherwise unbind its
        devices (with every side effect of unbind), unregister its drivers and unload it."""
        with self._transaction() as txn:
            fault = _take_fault(txn.state, f"unload:{name}")
            if fault is None:
                unload_module(txn.state, name)
        if fault is not None:
            raise fault

    def loaded_modules(self) -> list[str]:
        """Loaded module names, in load order."""
        return [m.name for m in self.snapshot().modules]

    def module_refcount(self, name: str) -> int:
        """``/sys/module/<name>/refcnt``; ENOENT when not loaded."""
        st = self.snapshot()
        if st.module(name) is None:
            raise kernel_error(errno.ENOENT, f"Module {name} is not currently loaded")
        return handles.refcount(st, name)

    def matching_modules(self, address: str) -> list[str]:
        """Known (installed) modules with a driver whose id table matches the device: udev's modalias
        lookup."""
        st = self.snapshot()
        dev = st.devices.get(address)
        if dev is None:
            raise kernel_error(errno.ENODEV, f"no PCI device {address}")
        out = []
        for mod in modules.known_modules(self.root, st.kernel_release):
            for drv in mod.drivers:
                if any(rule.matches(dev) and not rule.override_only for rule in drv.ids):
                    out.append(mod.name)
                    break
        return out

    # --- handles --------------------------------------------------------------------------------------------

    def open_handle(self, holder: str, kind: HandleKind, target: str) -> None:
        """``holder`` opens a device: ``("nvidia", BDF)`` a GPU's ``/dev/nvidiaN`` (GPU bound to nvidia, else
        ENODEV; EBUSY while its unbindLock is held), ``("vfio", BDF)`` a VFIO device (bound to a VFIO driver,
        or a vendor-vGPU VF with a type set; group must be viable and not owned by another holder, else
        EBUSY),
        ``("mdev", uuid)`` an mdev (EBUSY when another holder has it). Idempotent per (holder, kind,
        target)."""
        with self._transaction() as txn:
            handles.open_handle(txn.state, holder, kind, target)

    def close_handle(self, holder: str, kind: HandleKind, target: str) -> None:
        """Close one handle; EBADF when ``holder`` does not hold it."""
        with self._transaction() as txn:
            handles.close_handle(txn.state, holder, kind, target)

    def close_all(self, holder: str) -> int:
        """Close every handle of ``holder`` (process exit, VM stop); returns how many there were."""
        with self._transaction() as txn:
            return handles.close_all(txn.state, holder)

    def handles(self) -> list[Handle]:
        return list(self.snapshot().handles)

    # --- questions ------------------------------------------------------------------------------------------

    def snapshot(self) -> KernelState:
        """A copy of the kernel state (read-only use: changes to it are not saved)."""
        with state_mod.locked(self.root):
            return state_mod.load(self.root)

    def iommu_group_viable(self, group: int) -> bool:
        """Every member unbound or bound to a driver_managed_dma driver (what VFIO requires to open the
        group)."""
        st = self.snapshot()
        if not drivers.group_members(st, group):
            raise kernel_error(errno.ENOENT, f"no IOMMU group {group}")
        return drivers.group_viable(st, group)

    # --- test hooks and lifecycle ---------------------------------------------------------------------------

    def inject_fault(self, key: str, code: int, count: int = 1) -> None:
        """Fail the next ``count`` operations on ``key`` with ``code``: a write path as resolved
        (``sys/bus/pci/ drivers/nvidia/unbind``; symlinked spellings resolve to it) or ``load:<module>`` /
        ``unload:<module>``."""
        if count < 1:
            raise ValueError(f"fault count must be >= 1, got {count}")
        if code not in errno.errorcode:
            raise ValueError(f"unknown errno {code}")
        with self._transaction() as txn:
            if not key.startswith(("load:", "unload:")):
                key = self._resolve(key)
            txn.state.faults.append(Fault(key, code, count))

    def clear_faults(self) -> None:
        with self._transaction() as txn:
            txn.state.faults.clear()

    def reboot(self) -> None:
        """Power-cycle: every device present and unbound, no VFs, vGPUs, overrides, handles or loaded modules;
        built-in drivers probe. Loading modules at boot is userspace's job (modules-load.d, udev coldplug)."""
        with self._transaction() as txn:
            st = txn.state
            st.devices = {a: d for a, d in st.devices.items() if not d.is_vf}
            for dev in st.devices.values():
                dev.present, dev.driver, dev.driver_override = True, None, None
                dev.enable_cnt, dev.sriov_numvfs, dev.sriov_drivers_autoprobe = 0, 0, True
                dev.vfio_index, dev.vgpu_type, dev.unbind_lock = None, 0, False
            st.mdevs.clear()
            st.handles.clear()
            st.modules.clear()
            st.drivers.clear()
            st.bus_autoprobe = True
            for drv in modules.BUILTIN_DRIVERS:
                drivers.register_driver(st, _copy_driver(drv))

    def resync(self) -> None:
        """Rewrite every kernel file from the state (after a crash between save and apply, or a code
        upgrade)."""
        with state_mod.locked(self.root):
            text = state_mod.read_text(self.root)
            current = state_mod.parse(text)
            _finish_interrupted(self.root, text, current)  # takes away what an unfinished update left
            tree = sysfs.render(current)
            sysfs.apply(self.root, sysfs.Tree(), tree)
            _remember(text, tree)


# --- the rendered tree of the saved state -------------------------------------------------------------------
# Each operation needs the tree of the state it starts from, to diff against. It is the tree the previous
# operation rendered, so the kernel keeps the last few, keyed by the exact state text: a state written by
# another process, or anything else, has another text and is rendered afresh. Trees are never modified.

_TREE_CACHE_SIZE = 4
_TREES: dict[str, sysfs.Tree] = {}


def _tree_of(text: str, state: KernelState) -> sysfs.Tree:
    tree = _TREES.get(text) if sysfs.caching_enabled() else None
    if tree is None:
        tree = sysfs.render(state)
        _remember(text, tree)
    return tree


def _remember(text: str, tree: sysfs.Tree) -> None:
    if not sysfs.caching_enabled():
        return
    _TREES.pop(text, None)
    _TREES[text] = tree
    while len(_TREES) > _TREE_CACHE_SIZE:
        del _TREES[next(iter(_TREES))]


def _finish_interrupted(root: Path, text: str, current: KernelState) -> sysfs.Tree | None:
    """A process died between saving a state and updating the files: replay that update (every step of
    :func:`sysfs.apply` is idempotent) and return the tree now on disk; None when there is nothing to do."""
    previous = state_mod.interrupted(root)
    if previous is None:
        return None
    tree = sysfs.render(current)
    try:
        before = sysfs.render(state_mod.parse(previous))
    except (ValueError, KeyError, TypeError):  # unreadable (another version): rewrite everything instead
        before = sysfs.Tree()
    sysfs.apply(root, before, tree)
    state_mod.done(root)
    _remember(text, tree)
    return tree


# --- operations on a state (shared with the tree builder) ---------------------------------------------------


def _copy_driver(drv: state_mod.Driver) -> state_mod.Driver:
    return state_mod.Driver(
        drv.name, drv.module, list(drv.ids), [], drv.sriov_configure, drv.managed_dma, drv.vfio
    )


def register_builtin_drivers(st: KernelState) -> None:
    for drv in modules.BUILTIN_DRIVERS:
        drivers.register_driver(st, _copy_driver(drv))


def load_modules(root: Path, st: KernelState, name: str) -> list[str]:
    """Load ``name`` and its dependencies into ``st``; see :meth:`EmulatedKernel.load_module`."""
    order: list[modules.ModuleFile] = []
    visiting: set[str] = set()
    index = modules.read_modules_dep(root, st.kernel_release)

    def visit(mod_name: str) -> None:
        mod_name = mod_name.replace("-", "_")
        if st.module(mod_name) is not None or any(m.name == mod_name for m in order) or mod_name in visiting:
            return
        visiting.add(mod_name)
        mod = modules.read_module(root, st.kernel_release, mod_name, index)
        for dep in mod.depends:
            visit(dep)
        order.append(mod)

    visit(name)
    for mod in order:
        core = st.module("nvidia")
        if mod.flavour and mod.name != "nvidia" and core is not None and core.flavour != mod.flavour:
            raise kernel_error(
                errno.ENOENT,
                f"Unknown symbol in module {mod.name}: built for the {mod.flavour} nvidia, "
                f"the loaded nvidia is the {core.flavour} build",
            )
        st.modules.append(mod.loaded())
        for drv in mod.pci_drivers():
            drivers.register_driver(st, drv)
    return [m.name for m in order]


def unload_module(st: KernelState, name: str) -> None:
    """Unload ``name`` from ``st``; see :meth:`EmulatedKernel.unload_module`."""
    name = name.replace("-", "_")
    mod = st.module(name)
    if mod is None:
        raise kernel_error(errno.ENOENT, f"Module {name} is not currently loaded")
    refs = handles.refcount(st, name)
    if refs:
        users = st.holders_of(name) or [h.holder for h in st.handles]
        raise kernel_error(errno.EBUSY, f"Module {name} is in use (refcnt {refs}; by: {', '.join(users)})")
    for drv in mod.drivers:
        if drv in st.drivers:
            drivers.unregister_driver(st, drv)
    if name == nvidia.VGPU_VFIO_MODULE:
        nvidia.teardown_vgpu_manager(st)
    st.modules.remove(mod)


def _take_fault(st: KernelState, key: str) -> OSError | None:
    for fault in st.faults:
        if fault.key == key:
            fault.count -= 1
            if fault.count <= 0:
                st.faults.remove(fault)
            return kernel_error(fault.errno, "injected fault", key)
    return None


# --- attribute stores ---------------------------------------------------------------------------------------


def _device_name(value: str) -> str:
    """``sysfs_streq``: the name with one trailing newline ignored."""
    return value[:-1] if value.endswith("\n") else value


def _dispatch(st: KernelState, action: sysfs.Action, value: str) -> None:
    kind = action[0]
    if kind == "device":
        dev = st.devices[action[1]]
        _device_store(st, dev, action[2], value)
    elif kind == "driver":
        _driver_store(st, action[1], action[2], value)
    elif kind == "bus":
        _bus_store(st, action[1], value)
    elif kind == "mdev_type":
        nvidia.create_mdev(st, st.devices[action[1]], int(action[2]), value)
    elif kind == "mdev":
        nvidia.remove_mdev(st, action[1], value)
    elif kind == "vgpu_type":
        nvidia.write_current_vgpu_type(st, st.devices[action[1]], value)
    elif kind == "unbind_lock":
        nvidia.write_unbind_lock(st, st.devices[action[1]], value)
    else:  # a renderer/dispatcher mismatch is a bug, not a kernel answer
        raise AssertionError(f"unhandled attribute action {action!r}")


def _device_store(st: KernelState, dev: Device, attr: str, value: str) -> None:
    if attr == "driver_override":
        if len(value.encode()) >= PAGE_SIZE - 1:
            raise kernel_error(errno.EINVAL, f"driver_override longer than {PAGE_SIZE - 2} bytes")
        name = value.split("\n", 1)[0].split("\0", 1)[0]
        dev.driver_override = name or None  # writing does not unbind and does not probe
    elif attr == "enable":
        _store_enable(dev, value)
    elif attr == "numa_node":
        try:
            node = kstrtol(value)
        except ValueError:
            raise kernel_error(errno.EINVAL, f"numa_node expects an integer, got {value!r}") from None
        if node != -1 and not 0 <= node < sysfs.NUMA_NODES:
            raise kernel_error(errno.EINVAL, f"NUMA node {node} is not online")
        dev.numa_node = node
    elif attr == "remove":
        pci.write_remove(st, dev, value)
    elif attr == "rescan":
        if _nonzero(value, attr):
            pci.rescan(st, dev)
    elif attr == "reset":
        if _uint(value, attr) != 1:
            raise kernel_error(errno.EINVAL, "reset expects 1")
    elif attr == "sriov_numvfs":
        pci.write_sriov_numvfs(st, dev, value)
    elif attr == "sriov_drivers_autoprobe":
        dev.sriov_drivers_autoprobe = _kstrtobool(value)
    else:
        raise AssertionError(f"unhandled device attribute {attr!r}")


def _store_enable(dev: Device, value: str) -> None:
    number = _uint(value, "enable")
    if dev.driver is not None:
        raise kernel_error(errno.EBUSY, f"{dev.address} is bound to {dev.driver}")
    if number:
        dev.enable_cnt += 1
    elif dev.enable_cnt == 0:
        raise kernel_error(errno.EIO, f"{dev.address} is not enabled")
    else:
        dev.enable_cnt -= 1


def _driver_store(st: KernelState, name: str, attr: str, value: str) -> None:
    if attr == "bind":
        drivers.bind(st, name, _device_name(value))
    elif attr == "unbind":
        drivers.unbind(st, name, _device_name(value))
    elif attr == "new_id":
        drivers.new_id(st, name, value)
    elif attr == "remove_id":
        drivers.remove_id(st, name, value)
    else:
        raise AssertionError(f"unhandled driver attribute {attr!r}")


def _bus_store(st: KernelState, attr: str, value: str) -> None:
    if attr == "drivers_probe":
        dev = st.present(_device_name(value))
        if dev is None:
            raise kernel_error(errno.ENODEV, f"no PCI device {value.strip()!r}")
        drivers.attach(st, dev)  # success even when nothing binds: callers re-read the driver link
    elif attr == "drivers_autoprobe":
        st.bus_autoprobe = not value.startswith("0")
    elif attr == "rescan":
        if _nonzero(value, attr):
            pci.rescan(st)
    else:
        raise AssertionError(f"unhandled bus attribute {attr!r}")


def _uint(value: str, attr: str) -> int:
    try:
        return kstrtoul(value)
    except ValueError:
        raise kernel_error(errno.EINVAL, f"{attr} expects an unsigned integer, got {value!r}") from None


def _nonzero(value: str, attr: str) -> bool:
    return _uint(value, attr) != 0


def _kstrtobool(value: str) -> bool:
    first = value[:1].lower()
    if first in ("1", "y", "t"):
        return True
    if first in ("0", "n", "f"):
        return False
    if value[:2].lower() == "on":
        return True
    if value[:3].lower() == "off":
        return False
    raise kernel_error(errno.EINVAL, f"expected a boolean (0/1, y/n, on/off), got {value!r}")
