"""The program one boot of the test kernel runs (as root, inside the guest): every check, one process.

``python guest.py OUT`` loads the guest's drivers, runs each check through gpumode's own library functions
and writes ``OUT/results.json`` (one entry per check: ok, error, data, seconds). The tests on the host side
(``test_kernel.py``) judge those results; this side only records, so one failed check does not hide the rest.
``python guest.py hold DEVICE`` is the stand-in for a VM: it opens the device through VFIO the way QEMU does
(container, group, device fd) and holds it until its standard input closes.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys
import threading
import time
import traceback
import uuid as uuidlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import differential

# Guest devices (their addresses follow from the QEMU command line in conftest.py).
GPU = "0000:01:00.0"  # bochs-display, multifunction slot: the GPU stand-in
AUDIO = "0000:01:00.1"  # ich9-intel-hda in the same slot: the HDMI audio stand-in
NIC = "0000:02:00.0"  # e1000e alone on its root port
NVME = "0000:03:00.0"  # nvme with SR-IOV (sriov_max_vfs=2)
DRIVERS = ["bochs", "snd_hda_intel", "e1000e", "nvme", "vfio_pci", "mtty", "mdpy"]

# include/uapi/linux/vfio.h: _IO(VFIO_TYPE=';', VFIO_BASE + n)
VFIO_SET_IOMMU = 0x3B66
VFIO_GROUP_SET_CONTAINER = 0x3B68
VFIO_GROUP_GET_DEVICE_FD = 0x3B6A
VFIO_TYPE1_IOMMU = 1

Result = dict[str, Any]


def main(out: Path) -> int:
    from gpumode.host.root import Host

    host = Host("/")
    results: dict[str, Result] = {}

    def check(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        start = time.monotonic()
        entry: Result = {"ok": False, "error": None, "data": {}}
        try:
            entry["data"] = fn()
            entry["ok"] = True
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()
        entry["seconds"] = round(time.monotonic() - start, 2)
        results[name] = entry
        (out / "results.json").write_text(json.dumps(results, indent=1))

    check("setup", setup)
    check("discover", lambda: discovery(host))
    check("sriov", lambda: sriov(host))
    check("bind_group", lambda: bind_roundtrip(host, GPU))
    check("bind_single", lambda: bind_roundtrip(host, NIC))
    check("held_vfio", lambda: held_vfio(host))
    check("mdev", lambda: mdev(host))
    check("held_mdev", lambda: held_mdev(host))
    check("differential", lambda: {"rows": differential.run(host, hold_with_process)})
    return 0


def setup() -> dict[str, Any]:
    """No udev in the guest: load every driver explicitly."""
    times = {}
    for module in DRIVERS:
        start = time.monotonic()
        subprocess.run(["modprobe", module], check=True, capture_output=True, text=True)
        times[module] = round(time.monotonic() - start, 2)
    return {"modprobe_seconds": times}


def lspci() -> str:
    return subprocess.run(["lspci", "-D", "-nn", "-k"], check=True, capture_output=True, text=True).stdout


def groups() -> dict[str, list[str]]:
    base = Path("/sys/kernel/iommu_groups")
    return {g.name: sorted(os.listdir(g / "devices")) for g in base.iterdir()}


def parents() -> dict[str, str | None]:
    """Each function's upstream bridge (None on a root bus), from where the kernel put its directory."""
    found: dict[str, str | None] = {}
    for link in Path("/sys/bus/pci/devices").iterdir():
        parent = link.resolve().parent.name
        found[link.name] = parent if parent.count(":") == 2 else None
    return found


def discovery(host: Any) -> dict[str, Any]:
    from gpumode.host.discover import discover

    snapshot = discover(host)
    return {
        "snapshot": json.loads(snapshot.to_json()),
        "lspci": lspci(),
        "groups": groups(),
        "parents": parents(),
    }


def driver_of(address: str) -> str | None:
    link = Path("/sys/bus/pci/devices", address, "driver")
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def sriov(host: Any) -> dict[str, Any]:
    """Enable and disable the NVMe PF's VFs through gpumode; discovery and lspci see the real VFs between."""
    from gpumode.host import vgpu
    from gpumode.host.discover import discover

    # A QEMU NVMe VF has no controller resources until nvme-cli assigns them: nvme's probe of it would wait
    # for a timeout, so the VFs are created without autoprobe (as sriov-manage does for vGPU VFs).
    Path("/sys/bus/pci/devices", NVME, "sriov_drivers_autoprobe").write_text("0")
    vfs = vgpu.write_numvfs(host, NVME, 2)
    enabled = {"snapshot": json.loads(discover(host).to_json()), "lspci": lspci(), "groups": groups()}
    again = vgpu.write_numvfs(host, NVME, 2)  # already so: verified, nothing written
    vgpu.write_numvfs(host, NVME, 0)
    after = Path("/sys/bus/pci/devices", NVME, "sriov_numvfs").read_text().strip()
    return {"vfs": vfs, "again": again, "enabled": enabled, "numvfs_after_disable": after}


def bind_roundtrip(host: Any, address: str) -> dict[str, Any]:
    """The group to vfio-pci and back through gpumode, with the kernel's view of each step."""
    from gpumode.host import bind

    members = bind.vfio_members(host, address)
    start = {m: driver_of(m) for m in members}
    before = bind.bind_to_vfio(host, address, persist=False)
    bound = {m: driver_of(m) for m in members}
    vfio_group = Path("/dev/vfio", str(bind.iommu_group(host, address))).exists()
    after = bind.release_from_vfio(host, address, before)
    return {
        "members": members,
        "start": start,
        "recorded": before,
        "bound": bound,
        "dev_vfio_group": vfio_group,
        "after": after,
        "kernel_after": {m: driver_of(m) for m in members},
    }


class VmStandIn:
    """A child process holding a device open through VFIO, as QEMU does for a passthrough device."""

    def __init__(self, device: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "hold", device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "holding":
            self.release()
            raise RuntimeError(f"the VM stand-in could not open {device}: {line!r}")

    def release(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def hold_with_process(device: str) -> Callable[[], None]:
    return VmStandIn(device).release


def held_vfio(host: Any) -> dict[str, Any]:
    """A VFIO device held open: gpumode refuses to unbind naming the holder; the raw unbind really blocks,
    and finishes once the holder lets go."""
    from gpumode.host import bind
    from gpumode.host.root import WriteBlocked

    before = bind.bind_to_vfio(host, NIC, persist=False)
    vm = VmStandIn(NIC)
    data: dict[str, Any] = {"holder_pid": vm.proc.pid}
    try:
        start = time.monotonic()
        try:
            bind.release_from_vfio(host, NIC, before)
            data["refusal"] = None
        except bind.BindError as exc:
            data["refusal"] = str(exc)
        data["refusal_seconds"] = round(time.monotonic() - start, 2)
        data["driver_after_refusal"] = driver_of(NIC)
        # Past gpumode's check: the kernel's own answer to the unbind, given a short deadline.
        unbind = host.path("sys/bus/pci/drivers/vfio-pci/unbind")
        pending: threading.Thread | None = None
        try:
            host.write(unbind, NIC, deadline=3)
            data["raw_unbind"] = "returned"
        except WriteBlocked as exc:
            data["raw_unbind"] = "blocked"
            pending = exc.pending
        except OSError as exc:
            data["raw_unbind"] = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    finally:
        vm.release()
    if pending is not None:
        pending.join(30)
        data["raw_unbind_finished_after_release"] = not pending.is_alive()
    data["driver_after_release"] = driver_of(NIC)
    data["after"] = bind.release_from_vfio(host, NIC, before)
    return data


def mdev(host: Any) -> dict[str, Any]:
    """Create and remove an mdev on each sample parent through gpumode."""
    from gpumode.host import vgpu

    data: dict[str, Any] = {}
    for parent, type_id in (("mtty", "mtty-2"), ("mdpy", "mdpy-vga")):
        types = {t.type_id: t.available_instances for t in vgpu.supported_types(host, parent)}
        made = vgpu.create_mdev(host, parent, type_id, persist=False)
        listed = [(m.uuid, m.parent, m.type_id) for m in vgpu.list_mdevs(host)]
        again = vgpu.create_mdev(host, parent, type_id, made, persist=False)  # idempotent
        vgpu.remove_mdev(host, made)
        data[parent] = {
            "types": types,
            "created": made,
            "again": again,
            "listed": listed,
            "present_after_remove": Path("/sys/bus/mdev/devices", made).exists(),
        }
    return data


def held_mdev(host: Any) -> dict[str, Any]:
    """An mdev held open by a VM stand-in: gpumode's remove refuses naming the holder."""
    from gpumode.host import vgpu

    made = vgpu.create_mdev(host, "mtty", "mtty-1", str(uuidlib.uuid4()), persist=False)
    vm = VmStandIn(made)
    data: dict[str, Any] = {"holder_pid": vm.proc.pid, "uuid": made}
    try:
        start = time.monotonic()
        try:
            vgpu.remove_mdev(host, made)
            data["refusal"] = None
        except vgpu.VgpuError as exc:
            data["refusal"] = str(exc)
        data["refusal_seconds"] = round(time.monotonic() - start, 2)
        data["present_after_refusal"] = Path("/sys/bus/mdev/devices", made).exists()
    finally:
        vm.release()
    vgpu.remove_mdev(host, made)
    data["present_after_release"] = Path("/sys/bus/mdev/devices", made).exists()
    return data


def hold(device: str) -> int:
    """Open ``device`` (a PCI address or an mdev UUID) through VFIO and keep it until stdin closes."""
    libc = ctypes.CDLL(None, use_errno=True)
    bus = "mdev" if ":" not in device else "pci"
    group = os.path.basename(os.readlink(f"/sys/bus/{bus}/devices/{device}/iommu_group"))
    try:
        container = os.open("/dev/vfio/vfio", os.O_RDWR)
        group_fd = os.open(f"/dev/vfio/{group}", os.O_RDWR)
        steps = [
            (group_fd, VFIO_GROUP_SET_CONTAINER, ctypes.byref(ctypes.c_int(container))),
            (container, VFIO_SET_IOMMU, ctypes.c_ulong(VFIO_TYPE1_IOMMU)),
            (group_fd, VFIO_GROUP_GET_DEVICE_FD, ctypes.c_char_p(device.encode())),
        ]
        for fd, request, arg in steps:
            if libc.ioctl(fd, ctypes.c_ulong(request), arg) < 0:
                raise OSError(ctypes.get_errno(), f"ioctl {request:#x} on {device}")
    except OSError as exc:
        print(f"error: {exc}", flush=True)
        return 1
    print("holding", flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        sys.exit(hold(sys.argv[2]))
    sys.exit(main(Path(sys.argv[1])))
