"""SR-IOV on an NVIDIA GPU with gpumode's own kernel writes: repair what an interrupted ``sriov-manage`` left,
and change the VF count when the tool is gone.

NVIDIA's ``sriov-manage`` (shipped with the vGPU manager) moves the PF off nvidia to change ``sriov_numvfs``:
unbindLock → unbind → ``new_id`` to pci-pf-stub → bind → ``sriov_numvfs`` → unbind pci-pf-stub →
``remove_id`` → bind nvidia → bind the VFs to nvidia (docs: reference "sriov-manage"). Cut off anywhere in
between it leaves the PF driverless or on pci-pf-stub and the GPU's id among pci-pf-stub's dynamic ids, after
which every later ``sriov-manage`` fails on ``new_id`` with EEXIST. :func:`settle` undoes those leftovers;
:func:`set_num_vfs` is the same dance done by gpumode, for an undo that runs after the vGPU package (and its
``sriov-manage``) was removed. ``new_id`` is write-only in sysfs, so a stale id is found by removing it:
``remove_id`` answers ENODEV when there is none (drivers/pci/pci-driver.c ``remove_id_store``).
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

from gpumode.host import bind
from gpumode.host.root import Host

PF_STUB = "pci-pf-stub"
NVIDIA = "nvidia"


class SriovError(RuntimeError):
    """The VF count of a GPU could not be changed or its leftovers repaired; names the PF."""


def _dev(host: Host, pf: str) -> Path:
    return host.path("sys/bus/pci/devices", pf)


def _driver_dir(host: Host, name: str) -> Path:
    return host.path("sys/bus/pci/drivers", name)


def num_vfs(host: Host, pf: str) -> int:
    return int((_dev(host, pf) / "sriov_numvfs").read_text().strip() or "0")


def _ids(host: Host, pf: str) -> str:
    dev = _dev(host, pf)
    vendor = (dev / "vendor").read_text().strip().removeprefix("0x")
    device = (dev / "device").read_text().strip().removeprefix("0x")
    return f"{vendor} {device}"


def vfs(host: Host, pf: str) -> list[str]:
    return sorted(p.resolve().name for p in _dev(host, pf).glob("virtfn*"))


def leftovers(host: Host, pf: str) -> list[str]:
    """What an interrupted VF change visibly left on ``pf`` (a stale dynamic id cannot be seen, only
    removed)."""
    found = []
    driver = bind.current_driver(host, pf)
    if driver == PF_STUB:
        found.append(f"{pf} is bound to {PF_STUB}")
    elif driver is None and _driver_dir(host, NVIDIA).is_dir():
        found.append(f"{pf} has no driver")
    if driver == NVIDIA:
        found += [f"VF {vf} has no driver" for vf in vfs(host, pf) if bind.current_driver(host, vf) is None]
    return found


def settle(host: Host, pf: str) -> list[str]:
    """Undo the leftovers of an interrupted ``sriov-manage`` on ``pf``: drop its id from pci-pf-stub, give
    the PF (and then its VFs) back to nvidia when nvidia is loaded. The VF count stays as it is. Returns what
    it repaired."""
    repaired = []
    if _driver_dir(host, PF_STUB).is_dir():
        try:
            host.write(_driver_dir(host, PF_STUB) / "remove_id", _ids(host, pf))
            repaired.append(f"removed the stale id {_ids(host, pf)} from {PF_STUB}")
        except OSError as exc:
            if exc.errno != errno.ENODEV:  # ENODEV: there was none
                raise SriovError(f"{pf}: cannot remove its id from {PF_STUB}: {exc.strerror}") from exc
    if bind.current_driver(host, pf) == PF_STUB:
        _write(host, _driver_dir(host, PF_STUB) / "unbind", pf)
        repaired.append(f"unbound {pf} from {PF_STUB}")
    if bind.current_driver(host, pf) is None and _driver_dir(host, NVIDIA).is_dir():
        _write(host, _driver_dir(host, NVIDIA) / "bind", pf)
        repaired.append(f"bound {pf} to {NVIDIA}")
    if bind.current_driver(host, pf) == NVIDIA:
        for vf in vfs(host, pf):
            if bind.current_driver(host, vf) is None and bind.driver_override(host, vf) in (None, NVIDIA):
                _write(host, _driver_dir(host, NVIDIA) / "bind", vf)
                repaired.append(f"bound VF {vf} to {NVIDIA}")
    return repaired


def set_num_vfs(host: Host, pf: str, enable: bool) -> None:
    """Enable all VFs of ``pf`` (``sriov_totalvfs``) or disable them, as ``sriov-manage -e|-d`` would, with
    gpumode's own writes. Whatever happens, pci-pf-stub is left without the PF's id and the PF goes back to
    nvidia when nvidia is loaded."""
    dev = _dev(host, pf)
    want = int((dev / "sriov_totalvfs").read_text().strip()) if enable else 0
    if (num_vfs(host, pf) > 0) == enable:
        settle(host, pf)
        return
    if not _driver_dir(host, PF_STUB).is_dir():
        result = host.run(["modprobe", PF_STUB])
        if not result.ok:
            raise SriovError(f"{pf}: cannot load {PF_STUB}: {result.stderr.strip() or result.returncode}")
    try:
        if not enable:
            for vf in vfs(host, pf):
                driver = bind.current_driver(host, vf)
                if driver is not None:
                    _write(host, _driver_dir(host, driver) / "unbind", vf)
        if bind.current_driver(host, pf) == NVIDIA:
            try:
                bind.release_from_nvidia(host, pf)
            except bind.BindError as exc:
                raise SriovError(str(exc)) from exc
        driver = bind.current_driver(host, pf)
        if driver not in (None, PF_STUB):
            _write(host, _driver_dir(host, driver) / "unbind", pf)
        with contextlib.suppress(OSError):  # EEXIST: a stale id already makes pci-pf-stub match
            host.write(_driver_dir(host, PF_STUB) / "new_id", _ids(host, pf))
        if bind.current_driver(host, pf) != PF_STUB:
            _write(host, _driver_dir(host, PF_STUB) / "bind", pf)
        _write(host, dev / "sriov_numvfs", str(want))
    finally:
        settle(host, pf)
    if (num_vfs(host, pf) > 0) != enable:
        raise SriovError(f"{pf}: sriov_numvfs reads {num_vfs(host, pf)} after writing {want}")


def _write(host: Host, path: Path, value: str) -> None:
    try:
        host.write(path, value)
    except OSError as exc:
        raise SriovError(f"writing {value} to /{host.relative(path)} failed: {exc.strerror}") from exc
