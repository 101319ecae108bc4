"""Who holds a device open, and kernel writes that wait for those holders.

On a real kernel, unbinding a VFIO device, writing ``sriov_numvfs`` while a VF is in use and removing an
mdev do not fail while a VM has the device open: they *block* until it is closed
(``vfio_unregister_group_dev`` waits for the last user, asking it every 10 s to let go; Linux 6.1
``drivers/vfio/vfio_main.c``). So before such a write gpumode looks for the holders — processes with the
device's VFIO group (``/dev/vfio/<group>``), its VFIO cdev (``/dev/vfio/devices/vfioN``) or its NVIDIA node
(``/dev/nvidia<minor>``) open, found through ``/proc/<pid>/fd`` as ``fuser`` does — and refuses, naming them.
A write that blocks anyway (a holder gpumode cannot see) is given a deadline and reported as failed, naming
the device and whatever holds it by then.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpumode.host.root import Host, WriteBlocked

# How long a write that may wait for a device's users gets before gpumode reports it as blocked. A driver's
# remove() without users takes well under a second, even under an emulated CPU.
BLOCKING_WRITE_DEADLINE = 20.0

_MINOR = re.compile(r"^Device Minor:\s*(\d+)\s*$", re.MULTILINE)


class DeviceHeld(RuntimeError):
    """A device is open by a process (a VM, a CUDA job): the write that would wait for it is refused."""


@dataclass(frozen=True, slots=True)
class Holder:
    """A process with one of a device's files open."""

    pid: int
    command: str
    path: str

    def __str__(self) -> str:
        return f"{self.command} (pid {self.pid}) has {self.path} open"


def pci_device_files(host: Host, address: str) -> list[str]:
    """The device files through which a process uses the PCI function ``address`` (absent ones included: a
    process may hold a file whose device went away)."""
    dev = host.path("sys/bus/pci/devices", address)
    files: list[str] = []
    group = dev / "iommu_group"
    if os.path.islink(group):
        files.append(f"/dev/vfio/{os.path.basename(os.readlink(group))}")
    files += _vfio_cdevs(dev)
    information = host.path("proc/driver/nvidia/gpus", address, "information")
    try:
        minor = _MINOR.search(information.read_text())
    except OSError:
        minor = None
    if minor:
        files.append(f"/dev/nvidia{minor.group(1)}")
    return files


def mdev_device_files(host: Host, uuid: str) -> list[str]:
    """The device files through which a process (a VM) uses the mdev ``uuid``: its VFIO group and cdev."""
    dev = host.path("sys/bus/mdev/devices", uuid)
    files: list[str] = []
    group = dev / "iommu_group"
    if os.path.islink(group):
        files.append(f"/dev/vfio/{os.path.basename(os.readlink(group))}")
    return files + _vfio_cdevs(dev)


def _vfio_cdevs(dev: Path) -> list[str]:
    try:
        return [f"/dev/vfio/devices/{name}" for name in sorted(os.listdir(dev / "vfio-dev"))]
    except OSError:
        return []


def holders(host: Host, files: Iterable[str]) -> list[Holder]:
    """Every process with one of ``files`` open, by pid (the ``/proc/<pid>/fd`` links, as ``fuser`` reads)."""
    wanted = set(files)
    if not wanted:
        return []
    found: list[Holder] = []
    proc = host.path("proc")
    try:
        pids = sorted(int(name) for name in os.listdir(proc) if name.isdigit())
    except OSError:
        return []
    for pid in pids:
        fd_dir = proc / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or a kernel thread
            continue
        opened = set()
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target in wanted:
                opened.add(target)
        if opened:
            command = _command(proc / str(pid))
            found += [Holder(pid, command, path) for path in sorted(opened)]
    return found


def _command(pid_dir: Path) -> str:
    """``comm``, plus the VM's name for a QEMU started by libvirt (``-name guest=<vm>,...``)."""
    try:
        comm = (pid_dir / "comm").read_text().strip() or "?"
        argv = (pid_dir / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    for flag, value in itertools.pairwise(argv):
        if flag == b"-name":
            name = value.decode(errors="replace").split(",")[0].removeprefix("guest=")
            return f"{comm} (VM {name})"
    return comm


def refuse_if_held(host: Host, what: str, files: Iterable[str]) -> None:
    """Raise :class:`DeviceHeld` naming every holder of ``files``; ``what`` names the device."""
    found = holders(host, files)
    if found:
        raise DeviceHeld(
            f"{what} is in use: {'; '.join(map(str, found))}. Stop it first (a VM: shut it down); the kernel "
            "would wait for it to close the device"
        )


def blocking_write(
    host: Host,
    path: Path,
    value: str,
    *,
    what: str,
    files: Iterable[str],
    deadline: float = BLOCKING_WRITE_DEADLINE,
) -> None:
    """Write to a kernel file whose store waits for the device's users: refuse while a holder is seen, else
    write with ``deadline``. A write still blocked then raises :class:`DeviceHeld` naming the device and the
    holders found by then (the write itself completes in the kernel once they let go). Other errors are the
    kernel's ``OSError``."""
    files = list(files)
    refuse_if_held(host, what, files)
    try:
        host.write(path, value, deadline=deadline)
    except WriteBlocked as exc:
        found = holders(host, files)
        held_by = "; ".join(map(str, found)) if found else "held by something no process has open"
        raise DeviceHeld(
            f"{what}: writing {value.strip()!r} to {host.relative(path)} was still blocked after "
            f"{deadline:g} s — {held_by}. The kernel finishes the write once the device is released"
        ) from exc
