"""Kernel modules, systemd services and driver packages, through :meth:`Host.run` only.

Commands are data (``INSTALLERS``, the argv lists below) so a plan can show them and the emulated userspace
can answer them. Each operation first checks whether it is already done — ``proc/modules``, systemd's runtime
files, ``var/lib/dpkg/status`` — so steps can be re-run after a crash. Command failures raise
:class:`~gpumode.host.root.CommandError` (the argv and its stderr); refusals raise :class:`DriverOpError`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpumode.domain import LoadedModule
from gpumode.host.holders import DeviceHeld, pci_device_files, refuse_if_held
from gpumode.host.root import CommandResult, CommandTimeout, Host

# modprobe -r unbinds the module's devices; each driver's remove() may take seconds (nvidia does)
MODULE_REMOVAL_TIMEOUT = 120.0


class DriverOpError(RuntimeError):
    """An operation was refused before running anything: bad input, or a host state that forbids it."""


# --- modules ------------------------------------------------------------------------------------------------

_MODULE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def module_name(name: str) -> str:
    """The kernel's spelling of a module name (``vfio-pci`` → ``vfio_pci``); rejects anything else."""
    if not _MODULE_NAME.match(name):
        raise DriverOpError(f"not a kernel module name: {name!r}")
    return name.replace("-", "_")


def loaded_modules(host: Host) -> dict[str, LoadedModule]:
    """``/proc/modules`` by name: ``<name> <size> <refcnt> <users>,|- <state> <addr> [taints]``."""
    path = host.path("proc/modules")
    if not path.exists():
        return {}
    modules: dict[str, LoadedModule] = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        refcount = int(fields[2]) if fields[2].lstrip("-").isdigit() else 0
        users = [u for u in fields[3].split(",") if u and u != "-"]
        modules[fields[0]] = LoadedModule(fields[0], int(fields[1]), refcount, users, fields[4])
    return modules


def module_loaded(host: Host, name: str) -> bool:
    return module_name(name) in loaded_modules(host)


def load_module(host: Host, name: str) -> None:
    """``modprobe <name>`` unless it is loaded already."""
    name = module_name(name)
    if not module_loaded(host, name):
        host.run(["modprobe", name], check=True)


def unload_module(host: Host, name: str) -> None:
    """``modprobe -r <name>``; refuses while other modules or processes hold it, naming them.

    The kernel would refuse too, with a bare "Module is in use"; the caller needs to know what to stop first.
    """
    name = module_name(name)
    module = loaded_modules(host).get(name)
    if module is None:
        return
    if "[permanent]" in module.users:
        raise DriverOpError(f"module {name} is permanent (no unload support) and cannot be unloaded")
    if module.users:
        raise DriverOpError(f"module {name} is used by {', '.join(module.users)}: unload those first")
    # Removing a PCI driver's module unbinds its devices, and a remove() waits for whoever has the device
    # open; refcnt only counts those users, so they are looked for and named first.
    for address in bound_devices(host, name):
        try:
            refuse_if_held(host, address, pci_device_files(host, address))
        except DeviceHeld as exc:
            raise DriverOpError(f"cannot unload {name}: {exc}") from exc
    if module.refcount > 0:
        raise DriverOpError(
            f"module {name} is held by {module.refcount} reference(s) (processes with its devices open, or "
            "bound devices): stop its users first"
        )
    try:
        host.run(["modprobe", "-r", name], check=True, timeout=MODULE_REMOVAL_TIMEOUT)
    except CommandTimeout as exc:
        raise DriverOpError(f"unloading {name} did not finish: {exc}") from exc
    if module_loaded(host, name):
        raise DriverOpError(f"modprobe -r {name} exited 0 but {name} is still in proc/modules")


def bound_devices(host: Host, name: str) -> list[str]:
    """The PCI functions bound to the drivers of module ``name`` (``sys/module/<m>/drivers/pci:<drv>``)."""
    drivers_dir = host.path("sys/module", module_name(name), "drivers")
    try:
        entries = os.listdir(drivers_dir)
    except OSError:
        return []
    found: list[str] = []
    for entry in sorted(entries):
        if not entry.startswith("pci:"):
            continue
        driver = host.path("sys/bus/pci/drivers", entry[4:])
        try:
            found += sorted(n for n in os.listdir(driver) if n.count(":") == 2 and "." in n)
        except OSError:
            continue
    return found


# --- services -----------------------------------------------------------------------------------------------

_UNIT = re.compile(r"^[A-Za-z0-9:_.@\\-]+$")


def unit_name(name: str) -> str:
    """A systemd unit name, ``.service`` added when no type is given."""
    if not _UNIT.match(name) or name.startswith("-"):
        raise DriverOpError(f"not a systemd unit name: {name!r}")
    return name if "." in name else f"{name}.service"


def service_active(host: Host, name: str) -> bool:
    """True while the unit is active: systemd keeps ``/run/systemd/units/invocation:<unit>`` for exactly that
    long; ``systemctl is-active`` answers when that file is not there (older systemd)."""
    unit = unit_name(name)
    if os.path.lexists(host.path("run/systemd/units", f"invocation:{unit}")):
        return True
    return host.run(["systemctl", "is-active", "--quiet", unit]).ok


def start_service(host: Host, name: str) -> None:
    unit = unit_name(name)
    if not service_active(host, unit):
        host.run(["systemctl", "start", unit], check=True)


def stop_service(host: Host, name: str, *, even_if_inactive: bool = False) -> None:
    """``systemctl stop``; ``even_if_inactive`` also when the unit does not report active (a start cut off
    halfway leaves it activating, its daemon already holding devices; stopping an inactive unit is a
    no-op)."""
    unit = unit_name(name)
    if even_if_inactive or service_active(host, unit):
        host.run(["systemctl", "stop", unit], check=True)


# --- packages -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Installer:
    """The argv prefixes of one package manager; package names are appended."""

    install: tuple[str, ...]
    remove: tuple[str, ...]


INSTALLERS: dict[str, Installer] = {
    "apt": Installer(
        install=("apt-get", "install", "-y", "-q", "--no-install-recommends"),
        remove=("apt-get", "purge", "-y", "-q"),
    ),
    "dnf": Installer(install=("dnf", "install", "-y", "-q"), remove=("dnf", "remove", "-y", "-q")),
}

# Debian policy package names, optionally pinned (``name=version``); nothing that could pass for an option.
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?$")


def _installer(name: str) -> Installer:
    try:
        return INSTALLERS[name]
    except KeyError:
        raise DriverOpError(f"unknown installer {name!r} (known: {', '.join(sorted(INSTALLERS))})") from None


def _package_names(names: Iterable[str]) -> list[str]:
    names = list(names)
    bad = [n for n in names if not _PACKAGE.match(n)]
    if bad:
        raise DriverOpError(f"not package names: {', '.join(map(repr, bad))}")
    return names


def installed_packages(host: Host) -> dict[str, str]:
    """Installed packages and their versions, from dpkg's status database."""
    path = host.path("var/lib/dpkg/status")
    if not path.exists():
        return {}
    installed: dict[str, str] = {}
    for stanza in path.read_text().split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line[:1] not in (" ", "\t") and ":" in line:
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
        # "install ok installed": wanted, no error, fully unpacked and configured
        if "Package" in fields and fields.get("Status", "").split()[-1:] == ["installed"]:
            installed[fields["Package"]] = fields.get("Version", "")
    return installed


def package_installed(host: Host, name: str) -> bool:
    return name.split("=", 1)[0] in installed_packages(host)


def install_packages(host: Host, names: Iterable[str], installer: str = "apt") -> list[str]:
    """Install the packages not installed yet; returns those it asked the installer for."""
    tool = _installer(installer)
    wanted = _package_names(names)
    have = installed_packages(host)
    missing = [n for n in wanted if n.split("=", 1)[0] not in have]
    if missing:
        host.run([*tool.install, *missing], check=True)
    return missing


def remove_packages(host: Host, names: Iterable[str], installer: str = "apt") -> list[str]:
    """Remove (purge) the packages that are installed; returns those it asked the installer to remove."""
    tool = _installer(installer)
    wanted = _package_names(names)
    have = installed_packages(host)
    present = [n for n in wanted if n.split("=", 1)[0] in have]
    if present:
        host.run([*tool.remove, *(n.split("=", 1)[0] for n in present)], check=True)
    return present


def run_command(host: Host, argv: Sequence[str]) -> CommandResult:
    """Run a post-install step (``update-initramfs -u``, ``nvidia-smi -pm 1``…); failure: CommandError."""
    argv = list(argv)
    if not argv or not all(isinstance(a, str) and a for a in argv):
        raise DriverOpError(f"not a command: {argv!r}")
    return host.run(argv, check=True)
