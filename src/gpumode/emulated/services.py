"""systemd on the emulated host: unit files, enablement, running units and ``systemctl``.

Laid out as systemd lays it out, so the same readers work on a real host: unit files in
``lib/systemd/system``, enabled units as links in ``etc/systemd/system/multi-user.target.wants``, and a
running unit as the ``run/systemd/units/invocation:<unit>`` link systemd keeps for exactly as long as the unit
is active.

A running NVIDIA daemon is more than a file: nvidia-persistenced and nvidia-vgpu-mgr keep ``/dev/nvidia*`` of
every GPU open, fabric manager its NVSwitches. They take kernel handles on start and close them on stop, so
unbinding a GPU or unloading ``nvidia`` fails while they run, exactly as on a real host.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from gpumode.domain import CLASS_NVSWITCH, GPU_CLASSES, NVIDIA_VENDOR
from gpumode.emulated.interrupts import signal_point
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.emulated.packages import UNIT_DIR, WANTS_DIR, Outcome, UnitDef, unit_def
from gpumode.emulated.state import KernelState

RUNTIME_DIR = "run/systemd/units"


def unit_name(name: str) -> str:
    """``nvidia-persistenced`` → ``nvidia-persistenced.service`` (what systemctl does with a bare name)."""
    return name if "." in name else f"{name}.service"


def unit_exists(root: Path, unit: str) -> bool:
    return (root / UNIT_DIR / unit).is_file()


def is_active(root: Path, unit: str) -> bool:
    return os.path.lexists(root / RUNTIME_DIR / f"invocation:{unit}")


def is_enabled(root: Path, unit: str) -> bool:
    return os.path.lexists(root / WANTS_DIR / unit)


def active_units(root: Path) -> list[str]:
    base = root / RUNTIME_DIR
    if not base.is_dir():
        return []
    return sorted(
        p.name.removeprefix("invocation:") for p in base.iterdir() if p.name.startswith("invocation:")
    )


def _failed(unit: str) -> Outcome:
    """What ``systemctl start`` prints when the daemon exits at once."""
    return (
        1,
        "",
        f"Job for {unit} failed because the control process exited with error code.\n"
        f'See "systemctl status {unit}" and "journalctl -xeu {unit}" for details.\n',
    )


def held_devices(st: KernelState, holds: str) -> list[str]:
    """What a running daemon opens: every GPU (PF) bound to nvidia, or every NVSwitch bound to it."""
    wanted = GPU_CLASSES if holds == "gpus" else {CLASS_NVSWITCH} if holds == "nvswitches" else set()
    return [
        d.address
        for d in st.present_devices()
        if d.vendor == NVIDIA_VENDOR and d.class_code in wanted and not d.is_vf and d.driver == "nvidia"
    ]


def _daemon_check(st: KernelState, unit: UnitDef) -> str | None:
    """Why the daemon would exit at once (what it would log), or None when it can run."""
    core = st.module("nvidia")
    if core is None:
        return "Failed to open /dev/nvidiactl: No such file or directory (nvidia module not loaded)"
    if unit.needs_flavour and core.flavour != unit.needs_flavour:
        return f"the loaded nvidia module is the {core.flavour or 'unknown'} build, not {unit.needs_flavour}"
    if unit.needs_nvswitch and not held_devices(st, "nvswitches"):
        return "no NVSwitch bound to the nvidia driver"
    return None


def start(root: Path, name: str) -> Outcome:
    unit = unit_name(name)
    if not unit_exists(root, unit):
        return 5, "", f"Failed to start {unit}: Unit {unit} not found.\n"
    if is_active(root, unit):
        return 0, "", ""
    found = unit_def(unit)
    if found is not None:
        definition = found[1]
        kernel = EmulatedKernel(root)
        st = kernel.snapshot()
        if _daemon_check(st, definition) is not None:
            return _failed(unit)
        try:
            for address in held_devices(st, definition.holds):
                kernel.open_handle(unit, "nvidia", address)
        except OSError:
            kernel.close_all(unit)  # the daemon exits: whatever it had opened is closed again
            return _failed(unit)
    signal_point(root, "middle")  # the daemon holds its devices, systemd does not count it active yet
    link = root / RUNTIME_DIR / f"invocation:{unit}"
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(secrets.token_hex(16), link)  # systemd's link target is the invocation id
    return 0, "", ""


def stop(root: Path, name: str) -> Outcome:
    unit = unit_name(name)
    if not unit_exists(root, unit) and not is_active(root, unit):
        return 5, "", f"Failed to stop {unit}: Unit {unit} not loaded.\n"
    EmulatedKernel(root).close_all(unit)
    signal_point(root, "middle")  # the daemon is gone, systemd still counts the unit active
    (root / RUNTIME_DIR / f"invocation:{unit}").unlink(missing_ok=True)
    return 0, "", ""


def enable(root: Path, name: str) -> Outcome:
    unit = unit_name(name)
    if not unit_exists(root, unit):
        return 1, "", f"Failed to enable unit: Unit file {unit} does not exist.\n"
    link = root / WANTS_DIR / unit
    if os.path.lexists(link):
        return 0, "", ""
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(f"/{UNIT_DIR}/{unit}", link)
    return 0, "", f"Created symlink /{WANTS_DIR}/{unit} → /{UNIT_DIR}/{unit}.\n"


def disable(root: Path, name: str) -> Outcome:
    unit = unit_name(name)
    link = root / WANTS_DIR / unit
    if not os.path.lexists(link):
        if not unit_exists(root, unit):
            return 1, "", f"Failed to disable unit: Unit file {unit} does not exist.\n"
        return 0, "", ""
    link.unlink()
    return 0, "", f'Removed "/{WANTS_DIR}/{unit}".\n'


# --- systemctl --------------------------------------------------------------------------------------------

_VERBS = (
    "start",
    "stop",
    "restart",
    "enable",
    "disable",
    "is-active",
    "is-enabled",
    "status",
    "daemon-reload",
)


def systemctl(root: Path, args: list[str]) -> Outcome:
    """``systemctl VERB [--quiet] [--now] UNIT…`` for the verbs gpumode and its operators use."""
    quiet = any(a in ("-q", "--quiet") for a in args)
    now = "--now" in args
    words = [a for a in args if not a.startswith("-")]
    unknown = [a for a in args if a.startswith("-") and a not in ("-q", "--quiet", "--now", "--no-pager")]
    if unknown:
        return 1, "", f"systemctl: unrecognized option '{unknown[0]}'\n"
    if not words:
        return 1, "", "Too few arguments.\n"
    verb, units = words[0], [unit_name(u) for u in words[1:]]
    if verb not in _VERBS:
        return 1, "", f'Unknown command verb "{verb}", expected one of: {", ".join(_VERBS)}.\n'
    if verb == "daemon-reload":
        return 0, "", ""
    if not units:
        return 1, "", f"Too few arguments.\nUsage: systemctl {verb} UNIT…\n"
    if verb == "is-active":
        states = ["active" if is_active(root, u) else "inactive" for u in units]
        rc = 0 if all(s == "active" for s in states) else 3
        return rc, "" if quiet else "".join(f"{s}\n" for s in states), ""
    if verb == "is-enabled":
        return _is_enabled(root, units, quiet)
    if verb == "status":
        return _status(root, units)
    out, err, rc = "", "", 0
    for unit in units:
        steps = {
            "start": [start],
            "stop": [stop],
            "restart": [stop, start],
            "enable": [enable, *([start] if now else [])],
            "disable": [disable, *([stop] if now else [])],
        }[verb]
        for step in steps:
            code, o, e = step(root, unit)
            if verb == "restart" and step is stop and code == 5:
                code, o, e = 0, "", ""  # restart of a stopped unit just starts it
            out, err = out + o, err + e
            if code:
                rc = rc or code
                break
    return rc, out, "" if quiet and rc == 0 else err


def _is_enabled(root: Path, units: list[str], quiet: bool) -> Outcome:
    out, err, rc = "", "", 0
    for unit in units:
        if not unit_exists(root, unit):
            err += f"Failed to get unit file state for {unit}: No such file or directory\n"
            rc = 1
            continue
        enabled = is_enabled(root, unit)
        out += "enabled\n" if enabled else "disabled\n"
        rc = rc or (0 if enabled else 1)
    return rc, "" if quiet else out, err


def _status(root: Path, units: list[str]) -> Outcome:
    out, rc = "", 0
    for unit in units:
        if not unit_exists(root, unit):
            return 4, out, f"Unit {unit} could not be found.\n"
        found = unit_def(unit)
        description = found[1].description if found else unit
        active = is_active(root, unit)
        vendor = "enabled" if is_enabled(root, unit) else "disabled"
        out += (
            f"{'●' if active else '○'} {unit} - {description}\n"
            f"     Loaded: loaded (/{UNIT_DIR}/{unit}; {vendor}; preset: enabled)\n"
            f"     Active: {'active (running)' if active else 'inactive (dead)'}\n"
        )
        rc = rc or (0 if active else 3)
    return rc, out, ""
