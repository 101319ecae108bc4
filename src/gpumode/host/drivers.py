"""The NVIDIA driver situation of a host: loaded modules, the driver's flavour and version, packages,
services.

Everything is read from files under the host root, as a real kernel, dpkg and systemd lay them out, so the
same code reads a real host and an emulated one. Each parser returns what it could read plus a list of
problems (short messages naming the path); nothing here raises on odd content.

Which build of ``nvidia`` runs (the data-center driver or the vGPU manager: one module, two builds) is told
from every piece of evidence a host offers, in this order (:func:`decide_flavour`):

1. ``sys/module/<name>/initstate`` — exists only for a loaded loadable module (built-in code with a
   ``sys/module`` entry has none): ``nvidia_vgpu_vfio`` means the vGPU manager; ``nvidia_uvm``,
   ``nvidia_modeset`` and ``nvidia_drm`` ship only with the data-center build.
2. ``proc/modules`` — the same, from the kernel's module list (also the source of the listed modules).
3. ``sys/bus/mdev/drivers`` — the vGPU manager registers its mdev driver ``nvidia-vgpu-vfio`` there; mdevs
   bound to it are live vGPUs.
4. the ``nvidia/`` directory (``current_vgpu_type``) on VFs — the vGPU 17+ vendor interface, also the vGPU
   manager's (discovery passes what it found).
5. ``proc/driver/nvidia/version`` — ``NVRM version: NVIDIA UNIX ... Kernel Module  <version>  ...`` (the open
   build says ``Open Kernel Module``): ``nvidia`` is loaded, and its version; it does not name the build.
   ``sys/module/nvidia/version`` gives the version when procfs does not, and ``sys/module/nvidia/taint``
   (``P`` = proprietary licence) tells open from proprietary.

A complete module list (1 or 2) without any vGPU-manager trace says data-center. Nothing is assumed: with
``nvidia`` loaded but no module list and no trace the build is unknown (``None``, a problem, GPUs on
``nvidia`` in mode ``unknown``), and evidence for both builds is a conflict reported the same way. Only when
``nvidia`` is not loaded do the installed packages say which build would load.

Other sources:

- ``var/lib/dpkg/status`` — installed packages, classified by name (:func:`classify_package`).
- ``run/systemd/units/invocation:<unit>`` — systemd creates it when a unit starts and removes it when the
  unit stops, so its presence means the unit is active.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpumode.domain import DriverState, Flavour, LoadedModule, Mode, NvidiaDriver, Package
from gpumode.host.root import Host

SERVICES = (
    "nvidia-persistenced.service",
    "nvidia-fabricmanager.service",
    "nvidia-vgpud.service",
    "nvidia-vgpu-mgr.service",
)

# Package name patterns, matched against the whole name (Debian/Ubuntu naming). The vGPU manager ships as
# ``nvidia-vgpu-ubuntu-<branch>`` (and NVIDIA's other ``nvidia-vgpu-*`` host packages). The data-center
# flavour is the driver (``nvidia-driver-<branch>-server[-open]`` and its ``nvidia-dkms``/``nvidia-utils``/
# ``linux-modules-nvidia`` parts, ``cuda-drivers``) and Fabric Manager, which is built per driver branch.
# The container toolkit and DCGM are no driver: they run beside either build (and stay installed when a host
# moves to vGPU), so they are listed without a flavour, like other ``nvidia``/``libnvidia`` packages.
_VGPU_PACKAGES = re.compile(r"nvidia-vgpu-.+|nvidia-vgpud?")
_DATACENTER_PACKAGES = re.compile(
    r"nvidia-driver-\d+(-server)?(-open)?"
    r"|nvidia-(headless|headless-no-dkms|dkms|utils|compute-utils|kernel-common|kernel-source)"
    r"-\d+(-server)?(-open)?"
    r"|linux-modules-nvidia-\d+(-server)?(-open)?-.+"
    r"|nvidia-fabricmanager(-dev)?-\d+"
    r"|cuda-drivers(-\d+)?"
)
_NVIDIA_PACKAGE = re.compile(r"(lib)?nvidia.*|cuda-drivers.*|datacenter-gpu-manager.*")
# Every name the patterns above can match starts with one of these: dpkg stanzas are looked up by them.
_DRIVER_PACKAGE_PREFIXES = (
    "nvidia",
    "libnvidia",
    "linux-modules-nvidia",
    "cuda-drivers",
    "datacenter-gpu-manager",
)

VGPU_MODULE = "nvidia_vgpu_vfio"
VGPU_MDEV_DRIVER = "nvidia-vgpu-vfio"  # the mdev driver's sysfs name (the module's, with hyphens)
DATACENTER_ONLY_MODULES = ("nvidia_uvm", "nvidia_modeset", "nvidia_drm")  # not shipped by the vGPU build
MDEV_DRIVERS = "sys/bus/mdev/drivers"
_NVRM_VERSION = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")
_VERSION = re.compile(r"^\d+(?:\.\d+)+$")
_MODULE_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def classify_package(name: str) -> Flavour | None:
    """The driver flavour a package belongs to, by its name; ``None`` when it belongs to neither."""
    if _VGPU_PACKAGES.fullmatch(name):
        return Flavour.VGPU
    if _DATACENTER_PACKAGES.fullmatch(name):
        return Flavour.DATACENTER
    return None


@dataclass(slots=True)
class FlavourEvidence:
    """What the host shows about the ``nvidia`` build, each entry naming its source."""

    vgpu: list[str] = field(default_factory=list)  # traces of the vGPU manager
    datacenter: list[str] = field(default_factory=list)  # modules only the data-center build ships
    module_list: str | None = None  # where a complete list of loaded modules was read, if anywhere


@dataclass(slots=True)
class DriverFacts:
    """What :func:`read_driver_facts` found; ``problems`` name the path of every odd thing."""

    modules: list[LoadedModule]
    nvidia: NvidiaDriver
    problems: list[str] = field(default_factory=list)
    evidence: FlavourEvidence = field(default_factory=FlavourEvidence)


# --- small file helpers -----------------------------------------------------------------------------------


def _read_text(path: str) -> str | None:
    """Whole file as text; ``None`` if it does not exist. Other OSErrors propagate: callers report them."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return None


# --- proc/modules -----------------------------------------------------------------------------------------


def parse_proc_modules(text: str, source: str = "proc/modules") -> tuple[list[LoadedModule], list[str]]:
    """Parse ``/proc/modules`` (kernel/module/procfs.c ``m_show``).

    Line: ``<name> <size> <refcnt> <users>,|- <Live|Loading|Unloading> 0x<addr>[ (<taints>)]``. Users end
    with a comma; ``-`` means none; ``[permanent]`` marks a module that cannot be unloaded and is not a
    user, so it is dropped. Without CONFIG_MODULE_UNLOAD the kernel prints ``-`` for refcnt and users:
    refcount is then ``-1``.
    """
    modules: list[LoadedModule] = []
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) < 5 or not _MODULE_NAME.match(parts[0]) or not parts[1].isdigit():
            problems.append(f"{source}:{number}: unreadable line {line[:80]!r}")
            continue
        name, size, refcnt, users, state = parts[:5]
        if refcnt == "-":
            refcount = -1
        elif refcnt.isdigit():
            refcount = int(refcnt)
        else:
            problems.append(f"{source}:{number}: unreadable refcount {refcnt!r} of {name}")
            refcount = -1
        user_list = [u for u in users.split(",") if u and u not in ("-", "[permanent]")]
        modules.append(LoadedModule(name, int(size), refcount, user_list, state))
    modules.sort(key=lambda m: m.name)
    return modules, problems


def _modules_from_sysfs(host: Host) -> list[str] | None:
    """Loadable modules that are loaded, from ``sys/module/*/initstate``; ``None`` without ``sys/module``."""
    base = host.path("sys/module")
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    return sorted(name for name in entries if os.path.exists(os.path.join(base, name, "initstate")))


def _mdev_driver_evidence(host: Host, evidence: FlavourEvidence, problems: list[str]) -> None:
    """``sys/bus/mdev/drivers/nvidia-vgpu-vfio`` (and the mdevs bound to it) is the vGPU manager's."""
    base = host.path(MDEV_DRIVERS)
    try:
        drivers = os.listdir(base)
    except FileNotFoundError:
        return
    except OSError as exc:
        problems.append(f"{MDEV_DRIVERS}: unreadable ({exc.strerror or exc})")
        return
    for name in drivers:
        if name.replace("_", "-") != VGPU_MDEV_DRIVER:
            continue
        try:
            bound = [e for e in os.listdir(base / name) if os.path.islink(base / name / e)]
        except OSError:
            bound = []
        live = f": {len(bound)} mdev(s) bound" if bound else ""
        evidence.vgpu.append(f"{MDEV_DRIVERS}/{name}{live}")


# --- the nvidia module ------------------------------------------------------------------------------------


def parse_nvrm_version(text: str) -> tuple[str | None, bool | None]:
    """Version and open-or-not from ``/proc/driver/nvidia/version`` (``NVRM version: ...`` first line)."""
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            match = _NVRM_VERSION.search(line)
            version = match.group(1) if match else None
            return version, "Open Kernel Module" in line
    return None, None


def _nvidia_module_facts(host: Host, problems: list[str]) -> tuple[str | None, bool | None]:
    """(version, open kernel module) of the ``nvidia`` module from procfs, else from sysfs."""
    version: str | None = None
    is_open: bool | None = None
    proc_path = host.path("proc/driver/nvidia/version")
    try:
        text = _read_text(str(proc_path))
    except OSError as exc:
        problems.append(f"proc/driver/nvidia/version: unreadable ({exc.strerror or exc})")
        text = None
    if text is not None:
        version, is_open = parse_nvrm_version(text)
        if version is None:
            problems.append("proc/driver/nvidia/version: no driver version in 'NVRM version:' line")
    sys_version_path = host.path("sys/module/nvidia/version")
    try:
        sys_version = _read_text(str(sys_version_path))
    except OSError as exc:
        problems.append(f"sys/module/nvidia/version: unreadable ({exc.strerror or exc})")
        sys_version = None
    if sys_version is not None:
        sys_version = sys_version.strip()
        if not _VERSION.match(sys_version):
            problems.append(f"sys/module/nvidia/version: not a version: {sys_version[:40]!r}")
        elif version is None:
            version = sys_version
        elif version != sys_version:
            problems.append(
                f"sys/module/nvidia/version says {sys_version} but proc/driver/nvidia/version says {version}"
            )
    if is_open is None:
        try:
            taint = _read_text(str(host.path("sys/module/nvidia/taint")))
        except OSError:
            taint = None
        if taint is not None:
            # The proprietary build carries the "P" (proprietary licence) taint; the open one is MIT/GPL.
            is_open = "P" not in taint.strip()
    return version, is_open


# --- dpkg -------------------------------------------------------------------------------------------------


def parse_dpkg_status(text: str, prefixes: tuple[str, ...] = ("",)) -> list[tuple[str, str]]:
    """(name, version) of every installed package whose name starts with one of ``prefixes``, from
    ``var/lib/dpkg/status``.

    The file is a series of RFC 822-style stanzas separated by blank lines; continuation lines start with a
    space, so a ``Package:`` at the start of a line always opens a field. A package is installed when the last
    word of its ``Status:`` is ``installed`` (not ``config-files`` or ``half-installed``). A server's status
    file runs to megabytes, so the wanted stanzas are found with ``str.find`` and only they are parsed.
    """
    text = "\n" + text
    starts: set[int] = set()
    for prefix in prefixes:
        needle = "\nPackage: " + prefix
        pos = text.find(needle)
        while pos >= 0:
            starts.add(pos)
            pos = text.find(needle, pos + 1)
    installed: list[tuple[str, str]] = []
    for pos in sorted(starts):
        begin = text.rfind("\n\n", 0, pos + 1) + 1  # Package: is usually, not necessarily, the first field
        end = text.find("\n\n", pos + 1)
        fields: dict[str, str] = {}
        for line in text[begin : len(text) if end < 0 else end].splitlines():
            if line and line[0] not in " \t#":
                key, sep, value = line.partition(":")
                if sep:
                    fields[key.strip().lower()] = value.strip()
        name, status = fields.get("package", ""), fields.get("status", "").split()
        if name and status and status[-1] == "installed":
            installed.append((name, fields.get("version", "")))
    return installed


def driver_packages(installed: Iterable[tuple[str, str]]) -> list[Package]:
    """The NVIDIA driver packages among the installed ones, each with its flavour (``None``: neither)."""
    packages = [
        Package(name, version, classify_package(name))
        for name, version in installed
        if _NVIDIA_PACKAGE.fullmatch(name) or classify_package(name) is not None
    ]
    packages.sort(key=lambda p: p.name)
    return packages


# --- systemd ----------------------------------------------------------------------------------------------


def read_services(host: Host, problems: list[str], units: Iterable[str] = SERVICES) -> dict[str, bool]:
    """Unit name → active, from ``run/systemd/units/invocation:<unit>``.

    Empty when systemd's runtime directory is absent: then nothing can be said about any unit.
    """
    base = host.path("run/systemd/units")
    if not base.is_dir():
        problems.append("run/systemd/units: missing (no systemd runtime state): service states unknown")
        return {}
    return {unit: os.path.lexists(os.path.join(base, f"invocation:{unit}")) for unit in units}


# --- the whole picture ------------------------------------------------------------------------------------


def read_driver_facts(
    host: Host, pci_traces: Iterable[str] = (), *, nvidia_bound: bool = False
) -> DriverFacts:
    """Read modules, the NVIDIA driver, its packages and services of ``host``, and decide its build.

    ``pci_traces`` are the vGPU-manager traces discovery found in the PCI tree (source 4: VF ``nvidia/``
    directories, mdev types on nvidia-bound functions); ``nvidia_bound``: a function is bound to nvidia,
    which proves the module is loaded even where proc/modules cannot say so."""
    problems: list[str] = []
    modules: list[LoadedModule] = []
    try:
        text = _read_text(str(host.path("proc/modules")))
        if text is None:
            problems.append("proc/modules: missing; loaded modules taken from sys/module/*/initstate")
    except OSError as exc:
        problems.append(f"proc/modules: unreadable ({exc.strerror or exc}); modules taken from sys/module")
        text = None
    evidence = FlavourEvidence()
    from_sysfs = _modules_from_sysfs(host)
    loaded = set(from_sysfs or [])
    if from_sysfs is not None:
        evidence.module_list = "sys/module"
        _module_evidence("sys/module", loaded, evidence)
    if text is not None:
        modules, bad = parse_proc_modules(text)
        problems.extend(bad)
        listed = {m.name for m in modules}
        evidence.module_list = "proc/modules"
        _module_evidence("proc/modules", listed, evidence)
        loaded |= listed
    _mdev_driver_evidence(host, evidence, problems)

    evidence.vgpu.extend(pci_traces)

    nvidia = NvidiaDriver()
    nvidia.loaded = "nvidia" in loaded or nvidia_bound
    nvidia.vgpu_vfio_loaded = VGPU_MODULE in loaded

    try:
        status = _read_text(str(host.path("var/lib/dpkg/status")))
    except OSError as exc:
        problems.append(f"var/lib/dpkg/status: unreadable ({exc.strerror or exc})")
        status = None
    if status is not None:
        nvidia.packages = driver_packages(parse_dpkg_status(status, _DRIVER_PACKAGE_PREFIXES))
    nvidia.services = read_services(host, problems)

    if host.path("proc/driver/nvidia/version").exists():
        nvidia.loaded = True  # procfs has the file exactly while nvidia is loaded
    if nvidia.loaded or host.path("sys/module/nvidia").is_dir():
        nvidia.version, nvidia.open_kernel_module = _nvidia_module_facts(host, problems)
    nvidia.flavour = decide_flavour(nvidia, evidence, problems)
    return DriverFacts(modules, nvidia, problems, evidence)


def _module_evidence(source: str, loaded: set[str], evidence: FlavourEvidence) -> None:
    if VGPU_MODULE in loaded:
        evidence.vgpu.append(f"{source}: {VGPU_MODULE} loaded")
    only_dc = [m for m in DATACENTER_ONLY_MODULES if m in loaded]
    if only_dc:
        evidence.datacenter.append(f"{source}: {', '.join(only_dc)} loaded (data-center build only)")


def decide_flavour(
    nvidia: NvidiaDriver, evidence: FlavourEvidence, problems: list[str] | None = None
) -> Flavour | None:
    """Which build of the ``nvidia`` module the host runs (or, when none is loaded, would load).

    Loaded: any vGPU-manager trace → ``vgpu``; a data-center-only module, or a complete module list without
    such a trace → ``datacenter``; traces of both → ``None`` and a problem (a conflict); no module list and
    no trace → ``None`` and a problem (nothing to tell by). Not loaded: the flavour of the installed driver
    packages when there is exactly one, else ``None``. Both flavours installed at once cannot work (they
    ship the same module) and is reported.
    """
    out = problems if problems is not None else []
    installed = {p.flavour for p in nvidia.packages if p.flavour is not None}
    if len(installed) > 1:
        both = sorted(p.name for p in nvidia.packages if p.flavour is not None)
        out.append(
            "var/lib/dpkg/status: both data-center and vGPU-manager driver packages are installed "
            f"({', '.join(both)}; they ship the same nvidia module)"
        )
    if not nvidia.loaded:
        return next(iter(installed)) if len(installed) == 1 else None
    if evidence.vgpu and evidence.datacenter:
        out.append(
            "nvidia build unknown: the host shows both the vGPU manager "
            f"({'; '.join(evidence.vgpu)}) and the data-center driver ({'; '.join(evidence.datacenter)}); "
            "GPUs on nvidia are in mode unknown"
        )
        return None
    if evidence.vgpu:
        return Flavour.VGPU
    if evidence.datacenter or evidence.module_list is not None:
        return Flavour.DATACENTER
    out.append(
        "nvidia build unknown: nvidia is loaded, but there is no module list (proc/modules, sys/module) and "
        f"no vGPU-manager trace ({MDEV_DRIVERS}, VF nvidia/ directories); GPUs on nvidia are in mode unknown"
    )
    return None


def gpu_mode(driver: str | None, flavour: Flavour | None) -> Mode:
    """The mode a GPU is in, from the driver bound to it and the host's nvidia flavour (``None``: the build
    could not be told, so a GPU on nvidia is ``unknown``)."""
    if driver == "nvidia":
        if flavour is None:
            return Mode.UNKNOWN
        return Mode.VGPU if flavour is Flavour.VGPU else Mode.ACCEL
    if driver in ("vfio-pci", "nvgrace_gpu_vfio_pci"):
        return Mode.PASSTHROUGH
    return Mode.NONE


_STATE_OF_MODE = {
    Mode.ACCEL: DriverState.DATACENTER,
    Mode.VGPU: DriverState.VGPU_HOST,
    Mode.PASSTHROUGH: DriverState.VFIO,
    Mode.NONE: DriverState.NONE,
    Mode.UNKNOWN: DriverState.UNKNOWN,
}


def host_driver_state(modes: Iterable[Mode]) -> DriverState:
    """One word for the host: the state every GPU agrees on, ``mixed`` when they differ, ``none`` without
    GPUs.

    ``accel`` → ``datacenter``, ``vgpu`` → ``vgpu-host``, ``passthrough`` → ``vfio``, ``none`` → ``none``; a
    host whose GPUs are in two or more different modes (including a GPU with no driver next to one with a
    driver) is ``mixed``.
    """
    states = {_STATE_OF_MODE[m] for m in modes}
    if not states:
        return DriverState.NONE
    if DriverState.UNKNOWN in states:
        return DriverState.UNKNOWN
    if len(states) == 1:
        return states.pop()
    return DriverState.MIXED
