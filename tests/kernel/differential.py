"""One sequence of kernel writes, run on the real kernel (in the guest) and on its emulated twin.

Every write goes through :meth:`Host.write` (a deadline turns a write that blocks into ``blocked``), every
command through :meth:`Host.run`; after each step the drivers, overrides, SR-IOV state and loaded modules of
what is involved are read back. ``run`` returns one row per step, the same shape on both sides, so the
host-side test can put them side by side. ``hold``/``release`` steps open and close the NIC through VFIO as a
VM would: the caller says how (a real process in the guest, a handle of the emulated kernel).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

GPU, AUDIO, NIC, NVME = "0000:01:00.0", "0000:01:00.1", "0000:02:00.0", "0000:03:00.0"
WATCHED = (GPU, AUDIO, NIC, NVME)
# the drivers QEMU's devices get from Debian's 6.1 kernel (each pci_driver's .name)
GPU_DRIVER, AUDIO_DRIVER, NIC_DRIVER, NVME_DRIVER = "bochs-drm", "snd_hda_intel", "e1000e", "nvme"

# (what it shows, path under the root, value written); a value of None reads the file instead, a path
# "run" runs the value split on spaces, "hold"/"release" open/close the device named by the value
STEPS: tuple[tuple[str, str, str | None], ...] = (
    ("bind to the driver it has", f"sys/bus/pci/drivers/{NIC_DRIVER}/bind", NIC),
    ("unbind from a driver it lacks", "sys/bus/pci/drivers/vfio-pci/unbind", NIC),
    ("read enable while bound", f"sys/bus/pci/devices/{NIC}/enable", None),
    ("read driver_override unset", f"sys/bus/pci/devices/{NIC}/driver_override", None),
    ("vfio-pci bind without override", "sys/bus/pci/drivers/vfio-pci/bind", NIC),
    ("override to vfio-pci", f"sys/bus/pci/devices/{NIC}/driver_override", "vfio-pci"),
    ("override does not unbind", f"sys/bus/pci/devices/{NIC}/driver_override", None),
    ("unbind from its driver", f"sys/bus/pci/drivers/{NIC_DRIVER}/unbind", NIC),
    ("read enable while unbound", f"sys/bus/pci/devices/{NIC}/enable", None),
    ("probe with override", "sys/bus/pci/drivers_probe", NIC),
    ("read enable on vfio-pci", f"sys/bus/pci/devices/{NIC}/enable", None),
    ("host driver bind while on vfio", f"sys/bus/pci/drivers/{NIC_DRIVER}/bind", NIC),
    ("clear override", f"sys/bus/pci/devices/{NIC}/driver_override", "\n"),
    ("unbind from vfio-pci", "sys/bus/pci/drivers/vfio-pci/unbind", NIC),
    ("probe back", "sys/bus/pci/drivers_probe", NIC),
    ("probe when bound", "sys/bus/pci/drivers_probe", NIC),
    ("probe unknown device", "sys/bus/pci/drivers_probe", "0000:99:00.0"),
    ("new_id one field", "sys/bus/pci/drivers/vfio-pci/new_id", "8086"),
    ("new_id", "sys/bus/pci/drivers/vfio-pci/new_id", "8086 10d3"),
    ("new_id again", "sys/bus/pci/drivers/vfio-pci/new_id", "8086 10d3"),
    ("remove_id", "sys/bus/pci/drivers/vfio-pci/remove_id", "8086 10d3"),
    ("remove_id again", "sys/bus/pci/drivers/vfio-pci/remove_id", "8086 10d3"),
    # the multi-function group, moved as libvirt/driverctl do, then undone the old (per-function) way
    ("override gpu", f"sys/bus/pci/devices/{GPU}/driver_override", "vfio-pci"),
    ("override audio", f"sys/bus/pci/devices/{AUDIO}/driver_override", "vfio-pci"),
    ("unbind gpu", f"sys/bus/pci/drivers/{GPU_DRIVER}/unbind", GPU),
    ("probe gpu", "sys/bus/pci/drivers_probe", GPU),
    ("unbind audio", f"sys/bus/pci/drivers/{AUDIO_DRIVER}/unbind", AUDIO),
    ("probe audio", "sys/bus/pci/drivers_probe", AUDIO),
    ("clear gpu override", f"sys/bus/pci/devices/{GPU}/driver_override", "\n"),
    ("gpu off vfio-pci", "sys/bus/pci/drivers/vfio-pci/unbind", GPU),
    ("probe gpu, audio still vfio", "sys/bus/pci/drivers_probe", GPU),
    ("bind gpu, audio still vfio", f"sys/bus/pci/drivers/{GPU_DRIVER}/bind", GPU),
    ("clear audio override", f"sys/bus/pci/devices/{AUDIO}/driver_override", "\n"),
    ("audio off vfio-pci", "sys/bus/pci/drivers/vfio-pci/unbind", AUDIO),
    ("probe gpu, group free", "sys/bus/pci/drivers_probe", GPU),
    ("probe audio, group free", "sys/bus/pci/drivers_probe", AUDIO),
    # SR-IOV on the NVMe PF
    ("read sriov_totalvfs", f"sys/bus/pci/devices/{NVME}/sriov_totalvfs", None),
    ("numvfs above total", f"sys/bus/pci/devices/{NVME}/sriov_numvfs", "3"),
    ("numvfs not a number", f"sys/bus/pci/devices/{NVME}/sriov_numvfs", "two"),
    ("VF autoprobe off", f"sys/bus/pci/devices/{NVME}/sriov_drivers_autoprobe", "0"),
    ("numvfs 1", f"sys/bus/pci/devices/{NVME}/sriov_numvfs", "1"),
    ("numvfs 1 again", f"sys/bus/pci/devices/{NVME}/sriov_numvfs", "1"),
    ("numvfs 1 to 2", f"sys/bus/pci/devices/{NVME}/sriov_numvfs", "2"),
    ("numvfs 0", f"sys/bus/pci/devices/{NVME}/sriov_numvfs", "0"),
    ("numvfs 0 again", f"sys/bus/pci/devices/{NVME}/sriov_numvfs", "0"),
    ("unbind the PF", f"sys/bus/pci/drivers/{NVME_DRIVER}/unbind", NVME),
    ("numvfs without PF driver", f"sys/bus/pci/devices/{NVME}/sriov_numvfs", "1"),
    ("PF back", "sys/bus/pci/drivers_probe", NVME),
    # modules with users; a module with bound devices
    ("rmmod a module in use", "run", "rmmod nvme_core"),
    ("rmmod with a device bound", "run", f"rmmod {NIC_DRIVER}"),
    ("modprobe probes its devices", "run", f"modprobe {NIC_DRIVER}"),
    # the NIC on vfio-pci, open by a VM
    ("override nic", f"sys/bus/pci/devices/{NIC}/driver_override", "vfio-pci"),
    ("nic off e1000e", f"sys/bus/pci/drivers/{NIC_DRIVER}/unbind", NIC),
    ("nic to vfio-pci", "sys/bus/pci/drivers_probe", NIC),
    ("a VM opens the nic", "hold", NIC),
    ("read enable while open", f"sys/bus/pci/devices/{NIC}/enable", None),
    ("unbind while open", "sys/bus/pci/drivers/vfio-pci/unbind", NIC),
    ("the VM closes it", "release", NIC),
    ("nic to vfio-pci again", "sys/bus/pci/drivers_probe", NIC),
    ("a VM opens it again", "hold", NIC),
    ("rmmod vfio_pci while open", "run", "rmmod vfio_pci"),
    ("the VM closes it again", "release", NIC),
    ("modprobe vfio_pci", "run", "modprobe vfio_pci"),
    ("clear nic override", f"sys/bus/pci/devices/{NIC}/driver_override", "\n"),
    ("nic off vfio-pci", "sys/bus/pci/drivers/vfio-pci/unbind", NIC),
    ("nic back", "sys/bus/pci/drivers_probe", NIC),
)
MODULES = ("e1000e", "nvme_core", "vfio_pci")

DEADLINE = 5.0


def _driver(host: Any, address: str) -> str:
    link = host.path("sys/bus/pci/devices", address, "driver")
    return os.path.basename(os.readlink(link)) if os.path.islink(link) else "-"


def _state(host: Any, *, overrides: bool = True) -> dict[str, str]:
    """What the step left. ``overrides=False`` while a write is blocked: on a real kernel the blocked unbind
    holds the device lock, and reading ``driver_override`` takes it too (it would block as well)."""
    state = {address[5:]: _driver(host, address) for address in WATCHED}
    for address in (GPU, AUDIO, NIC) if overrides else ():
        override = host.path("sys/bus/pci/devices", address, "driver_override").read_text().strip()
        if override != "(null)":
            state[f"{address[5:]} override"] = override
    pf = host.path("sys/bus/pci/devices", NVME)
    state["VFs"] = str(sum(1 for name in os.listdir(pf) if name.startswith("virtfn")))
    loaded = {line.split()[0] for line in host.path("proc/modules").read_text().splitlines()}
    state["modules"] = ",".join(m for m in MODULES if m in loaded)
    return state


Holder = Callable[[str], Callable[[], None]]


def run(host: Any, hold: Holder) -> list[dict[str, Any]]:
    """Run :data:`STEPS` on ``host``; one row per step: its outcome and the state after it. ``hold(device)``
    opens the device as a VM would and returns the function that closes it."""
    from gpumode.host.root import CommandTimeout, WriteBlocked

    rows = []
    held: dict[str, Callable[[], None]] = {}
    pending: list[Callable[[], object]] = []
    for what, rel, value in STEPS:
        path = host.path(rel)
        if rel == "hold":
            assert value is not None
            held[value] = hold(value)
            outcome = "ok"
        elif rel == "release":
            assert value is not None
            held.pop(value)()
            for waiter in pending:  # what blocked on the device finishes now
                waiter()
            pending.clear()
            outcome = "ok"
        elif rel == "run":
            assert value is not None
            try:
                result = host.run(value.split(), timeout=DEADLINE)
                message = (result.stderr or result.stdout).strip().splitlines()
                outcome = f"exit {result.returncode}" + (f": {message[0]}" if message else "")
            except CommandTimeout as timeout:
                outcome = "blocked"
                pending.append(lambda p=timeout.process: p.wait(30))
        elif value is None:
            try:
                outcome = "read " + path.read_text().strip()
            except OSError as exc:
                outcome = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        else:
            try:
                host.write(path, value, deadline=DEADLINE)
                outcome = "ok"
            except WriteBlocked as exc:
                outcome = "blocked"
                pending.append(lambda t=exc.pending: t.join(30))
            except OSError as exc:
                outcome = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        state = _state(host, overrides=not pending)
        rows.append({"step": what, "path": rel, "value": value, "outcome": outcome, "state": state})
    return rows
