"""Helpers shared by the engine's end-to-end tests (transitions, faults, CLI): emulated hosts, what a host
looks like for comparison, lspci's view, byte-for-byte tree digests, and running ``gpumode`` in a child
process."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpumode.domain import Mode, SwitchRequest
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.host.vms import open_hypervisor
from host_templates import emulated_host

FIXTURES = ("hgx-h100", "a16-vdi", "l40s-sriov", "t4-mdev", "rtx-workstation")
BRIDGE_CLASSES = frozenset({0x0600, 0x0604, 0x0609})
VFIO = "vfio-pci"


def make_host(directory: Path, fixture: str) -> Host:
    """A fresh emulated host of ``fixture`` at ``directory``: a copy of one built once per test session
    (building a fixture takes seconds; copying its tree is what every test can afford)."""
    return emulated_host(fixture, directory)


def reboot(host: Host) -> None:
    """Power-cycle the emulated host: VFs, vGPUs, bindings and loaded modules are gone."""
    from gpumode.emulated.kernel import EmulatedKernel

    EmulatedKernel(host.root).reboot()


def view(host: Host) -> dict[str, Any]:
    """What must be identical after a rollback: drivers and overrides of every function, vGPUs, VFs, modules,
    packages, services, and every VM's state and devices."""
    snap = discover(host)
    return {
        "functions": {f.address: (f.driver, f.driver_override) for f in snap.functions},
        "gpus": {g.address: (g.mode.value, sorted(g.mdevs), sorted(g.vgpus), len(g.vfs)) for g in snap.gpus},
        "modules": sorted(m.name for m in snap.modules),
        "packages": sorted((p.name, p.version) for p in snap.nvidia.packages),
        "services": dict(sorted(snap.nvidia.services.items())),
        "vms": vm_view(host),
    }


def vm_view(host: Host) -> dict[str, tuple[bool, list[str]]]:
    return {
        vm.name: (vm.running, sorted(str(d) for d in vm.devices)) for vm in open_hypervisor(host).list_vms()
    }


def tree_digest(root: Path) -> dict[str, str]:
    """Every file's bytes and every link's target under ``root``: the proof that nothing changed."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "link:" + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
            else:
                out[rel] = "dir"
    return out


_LSPCI_DEV = re.compile(r"^([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]) ", re.M)


def lspci_drivers(root: Path) -> dict[str, str | None]:
    """``lspci -k`` read from the emulated sysfs: address -> "Kernel driver in use" (None when unbound)."""
    out = subprocess.run(
        ["lspci", "-D", "-k", "-A", "linux-sysfs", "-O", f"sysfs.path={root}/sys/bus/pci"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    drivers: dict[str, str | None] = {}
    current = None
    for line in out.splitlines():
        m = _LSPCI_DEV.match(line)
        if m:
            current = m.group(1)
            drivers[current] = None
        elif current and "Kernel driver in use:" in line:
            drivers[current] = line.split(":", 1)[1].strip()
    return drivers


def check_drivers_with_lspci(host: Host, mode: Mode, gpus: list[str] | None = None) -> list[str]:
    """lspci must show the mode's driver on every GPU and every non-bridge companion; returns what differs."""
    snap = discover(host)
    seen = lspci_drivers(host.root)
    problems = []
    for gpu in snap.gpus:
        if gpus and gpu.address not in gpus:
            continue
        want_gpu = {Mode.PASSTHROUGH: VFIO, Mode.ACCEL: "nvidia", Mode.VGPU: "nvidia"}.get(mode)
        if seen.get(gpu.address) != want_gpu:
            problems.append(f"lspci: {gpu.address} driver {seen.get(gpu.address)}, expected {want_gpu}")
        for comp in gpu.companions:
            fn = snap.function(comp)
            if fn is None or (fn.class_code >> 8) in BRIDGE_CLASSES:
                continue
            on_vfio = seen.get(comp) == VFIO
            if (mode is Mode.PASSTHROUGH) != on_vfio:
                problems.append(
                    f"lspci: companion {comp} of {gpu.address} driver {seen.get(comp)} in {mode.value}"
                )
    return problems


def orphan_mdevs(host: Host) -> list[str]:
    """mdevs that exist but belong to no GPU discovery knows (their parent vanished or is not a GPU's)."""
    snap = discover(host)
    owned = {u for g in snap.gpus for u in g.mdevs}
    bus = host.path("sys/bus/mdev/devices")
    present = set(os.listdir(bus)) if bus.is_dir() else set()
    return sorted(present - owned)


def gpus_without_driver(host: Host) -> list[str]:
    return [g.address for g in discover(host).gpus if g.driver is None]


def gpumode_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", "from gpumode.cli.main import app; app()", *args]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``gpumode ARGS`` in a fresh Python process (what an operator runs)."""
    full_env = {**os.environ, **(env or {}), "COLUMNS": "200"}
    return subprocess.run(gpumode_argv(*args), capture_output=True, text=True, env=full_env, timeout=120)


def fork_cli(*args: str, env: dict[str, str]) -> int:
    """Run the ``gpumode`` CLI in a forked child (no interpreter start-up: the fault matrix needs hundreds of
    runs) with ``env`` added; return its wait status. The child is a real process: SIGKILL ends it for
    good."""
    pid = os.fork()
    if pid == 0:  # child
        code = 70
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.environ.update(env)
            from gpumode.cli.main import app

            rc = app(list(args), standalone_mode=False)
            code = rc if isinstance(rc, int) else 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            code = 71
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def killed(status: int) -> bool:
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def request_for(host: Host, mode: Mode) -> SwitchRequest | None:
    """A request for ``mode`` the host accepts (vgpu: the first vGPU type offered when none is set), or None
    when the host may not be in that mode at all (whitelist, compatibility)."""
    from gpumode.modes import engine
    from gpumode.modes.policy import RequestError

    request = SwitchRequest(mode)
    for _ in range(2):
        try:
            engine.plan(host, request)
            return request
        except RequestError as exc:
            if exc.code == "vgpu_type_required" and exc.choices:
                request = SwitchRequest(mode, vgpu_type=exc.choices[0])
                continue
            assert exc.code in ("mode_not_allowed", "incompatible_modes"), exc
            return None
    return None
