"""The emulated host's package catalogue and dpkg database: what ``apt-get`` can install, what is installed.

One catalogue of NVIDIA packages with real names and versions. Installing one does what its maintainer scripts
and dkms do on a real host: module files under ``lib/modules/<release>/updates/dkms`` (with ``depmod``), unit
files under ``lib/systemd/system`` enabled through ``multi-user.target.wants`` links, the tools it ships, and
a stanza in ``var/lib/dpkg/status`` in dpkg's own format. Removing one stops and disables its units first (its
``prerm``) but leaves loaded modules loaded, as a real ``apt-get remove`` does.

The data-center driver and the vGPU manager ship the same ``nvidia`` module and declare ``Conflicts`` on each
other: installing one while the other is installed fails as dpkg does (exit 100), the caller must remove
first.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gpumode.emulated import modules as kmodules
from gpumode.emulated.modules import ModuleFile

DPKG_STATUS = "var/lib/dpkg/status"
UNIT_DIR = "lib/systemd/system"
WANTS_DIR = "etc/systemd/system/multi-user.target.wants"

DATACENTER_VERSION = "550.127.05"
VGPU_VERSION = "550.127.06"
VGPU_R580_VERSION = "580.65.05"  # vGPU 19 KVM host driver (the a2-r580 fixture runs it)

Outcome = tuple[int, str, str]  # a command's exit status, stdout, stderr
GpuHold = str  # "gpus": /dev/nvidia<N> of every GPU on nvidia; "nvswitches": the NVSwitches; "": nothing


@dataclass(frozen=True, slots=True)
class UnitDef:
    """A systemd service a package ships, and what the running daemon needs and holds."""

    name: str  # "nvidia-persistenced.service"
    description: str
    exec_start: str
    holds: GpuHold = ""  # devices the running daemon keeps open (kernel handles)
    needs_flavour: str = ""  # the nvidia build it needs loaded ("" = either build)
    needs_nvswitch: bool = False

    def render(self) -> str:
        return (
            "[Unit]\n"
            f"Description={self.description}\n"
            "Wants=syslog.target\n\n"
            "[Service]\n"
            f"ExecStart={self.exec_start}\n\n"
            "[Install]\n"
            "WantedBy=multi-user.target\n"
        )


@dataclass(frozen=True, slots=True)
class PackageDef:
    """One installable package."""

    name: str
    version: str
    description: str
    size_kib: int
    flavour: str = ""  # "datacenter" | "vgpu" | "": which nvidia build it belongs to
    depends: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    module_files: Callable[[], list[ModuleFile]] | None = None
    units: tuple[UnitDef, ...] = ()
    files: dict[str, str] = field(default_factory=dict)  # path under the root -> content

    @property
    def deb(self) -> str:
        return f"{self.name}_{self.version}_amd64.deb"

    def modules(self) -> list[ModuleFile]:
        return self.module_files() if self.module_files is not None else []


def _tool(name: str, package: str) -> str:
    """The content of an emulated executable: a note on where the emulated userspace answers it."""
    return f"#!/bin/sh\n# {name} from {package} (emulated: gpumode.emulated.userspace answers it)\n"


_DC = "nvidia-driver-550-server"
_VGPU = "nvidia-vgpu-ubuntu-550"
_VGPU_580 = "nvidia-vgpu-ubuntu-580"


def _vgpu_manager(name: str, version: str, conflicts: tuple[str, ...]) -> PackageDef:
    """A vGPU manager package of one branch (every branch ships the same files and units)."""
    return PackageDef(
        name=name,
        version=version,
        description="NVIDIA vGPU Manager for Ubuntu KVM hosts",
        size_kib=118_932,
        flavour="vgpu",
        conflicts=conflicts,
        module_files=lambda: kmodules.nvidia_module_files("vgpu", version),
        units=(
            UnitDef(
                "nvidia-vgpud.service",
                "NVIDIA vGPU Daemon",
                "/usr/bin/nvidia-vgpud",
                needs_flavour="vgpu",
            ),
            UnitDef(
                "nvidia-vgpu-mgr.service",
                "NVIDIA vGPU Manager Daemon",
                "/usr/bin/nvidia-vgpu-mgr",
                holds="gpus",
                needs_flavour="vgpu",
            ),
        ),
        files={
            "usr/bin/nvidia-smi": _tool("nvidia-smi", name),
            "usr/bin/nvidia-vgpud": _tool("nvidia-vgpud", name),
            "usr/bin/nvidia-vgpu-mgr": _tool("nvidia-vgpu-mgr", name),
            "usr/lib/nvidia/sriov-manage": _tool("sriov-manage", name),
            "usr/share/nvidia/vgpu/vgpuConfig.xml": (
                '<?xml version="1.0" encoding="UTF-8"?>\n<vgpuconfig version="0x1" />\n'
            ),
        },
    )


CATALOGUE: dict[str, PackageDef] = {
    p.name: p
    for p in (
        PackageDef(
            name=_DC,
            version=f"{DATACENTER_VERSION}-0ubuntu0.24.04.1",
            description="NVIDIA Server Driver metapackage",
            size_kib=312_448,
            flavour="datacenter",
            conflicts=(_VGPU, _VGPU_580),
            module_files=lambda: kmodules.nvidia_module_files("datacenter", DATACENTER_VERSION),
            units=(
                UnitDef(
                    "nvidia-persistenced.service",
                    "NVIDIA Persistence Daemon",
                    "/usr/bin/nvidia-persistenced --user nvidia-persistenced --no-persistence-mode --verbose",
                    holds="gpus",
                ),
            ),
            files={
                "usr/bin/nvidia-smi": _tool("nvidia-smi", _DC),
                "usr/bin/nvidia-persistenced": _tool("nvidia-persistenced", _DC),
                "usr/bin/nvidia-debugdump": _tool("nvidia-debugdump", _DC),
            },
        ),
        PackageDef(
            name="nvidia-fabricmanager-550",
            version=f"{DATACENTER_VERSION}-1",
            description="Fabric Manager for NVSwitch based systems.",
            size_kib=18_210,
            flavour="datacenter",
            depends=(_DC,),
            units=(
                UnitDef(
                    "nvidia-fabricmanager.service",
                    "NVIDIA fabric manager service",
                    "/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg",
                    holds="nvswitches",
                    needs_flavour="datacenter",
                    needs_nvswitch=True,
                ),
            ),
            files={
                "usr/bin/nv-fabricmanager": _tool("nv-fabricmanager", "nvidia-fabricmanager-550"),
                "usr/share/nvidia/nvswitch/fabricmanager.cfg": "FM_STARTING_TCP_PORT=16000\nFABRIC_MODE=0\n",
            },
        ),
        PackageDef(
            name="nvidia-container-toolkit",
            version="1.16.2-1",
            description="NVIDIA Container toolkit",
            size_kib=5_876,
            files={
                "usr/bin/nvidia-ctk": _tool("nvidia-ctk", "nvidia-container-toolkit"),
                "usr/bin/nvidia-container-runtime": _tool(
                    "nvidia-container-runtime", "nvidia-container-toolkit"
                ),
            },
        ),
        _vgpu_manager(_VGPU, VGPU_VERSION, (_DC, _VGPU_580)),
        _vgpu_manager(_VGPU_580, VGPU_R580_VERSION, (_DC, _VGPU)),
    )
}


def unit_def(unit: str) -> tuple[PackageDef, UnitDef] | None:
    """The package shipping ``unit`` and its definition; None when no catalogue package does."""
    for pkg in CATALOGUE.values():
        for u in pkg.units:
            if u.name == unit:
                return pkg, u
    return None


# --- dpkg's status database -------------------------------------------------------------------------------


@dataclass(slots=True)
class Stanza:
    """One package's entry in ``var/lib/dpkg/status`` (field order kept as dpkg writes it)."""

    fields: dict[str, str]

    @property
    def package(self) -> str:
        return self.fields["Package"]

    @property
    def installed(self) -> bool:
        return self.fields.get("Status", "").split()[-1:] == ["installed"]

    def render(self) -> str:
        return "".join(f"{k}: {v}\n" for k, v in self.fields.items())


def read_status(root: Path) -> dict[str, Stanza]:
    """Every stanza of the status file by package name; missing file: none."""
    try:
        text = (root / DPKG_STATUS).read_text()
    except FileNotFoundError:
        return {}
    out: dict[str, Stanza] = {}
    for block in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        last = ""
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and last:
                fields[last] += "\n" + line
                continue
            key, sep, value = line.partition(":")
            if sep:
                last = key.strip()
                fields[last] = value.strip()
        if "Package" in fields:
            out[fields["Package"]] = Stanza(fields)
    return out


def write_status(root: Path, stanzas: Iterable[Stanza]) -> None:
    path = root / DPKG_STATUS
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(stanzas, key=lambda s: s.package)
    tmp = path.with_name("status-new")
    tmp.write_text("\n".join(s.render() for s in ordered))
    tmp.replace(path)  # dpkg writes status-new and renames it, so readers never see half a database


def installed(root: Path) -> dict[str, str]:
    """Installed packages (``install ok installed``) and their versions."""
    return {name: s.fields.get("Version", "") for name, s in read_status(root).items() if s.installed}


def _stanza(pkg: PackageDef) -> Stanza:
    fields = {
        "Package": pkg.name,
        "Status": "install ok installed",
        "Priority": "optional",
        "Section": "non-free/libs" if pkg.flavour else "utils",
        "Installed-Size": str(pkg.size_kib),
        "Maintainer": "NVIDIA Corporation <linux-bugs@nvidia.com>",
        "Architecture": "amd64",
        "Version": pkg.version,
    }
    if pkg.depends:
        fields["Depends"] = ", ".join(pkg.depends)
    if pkg.conflicts:
        fields["Conflicts"] = ", ".join(pkg.conflicts)
    fields["Description"] = pkg.description
    return Stanza(fields)


# --- what dpkg's unpack / remove do to the file system ----------------------------------------------------


def unpack(root: Path, pkg: PackageDef) -> None:
    """Put the package's files in place and record it as installed (unpack + configure)."""
    for rel, content in pkg.files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        if rel.startswith(("usr/bin/", "usr/lib/nvidia/")):
            path.chmod(0o755)
    for unit in pkg.units:
        path = root / UNIT_DIR / unit.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(unit.render())
    if pkg.module_files is not None:
        kmodules.install_module_files(root, pkg.modules())
    stanzas = read_status(root)
    stanzas[pkg.name] = _stanza(pkg)
    write_status(root, stanzas.values())


def delete(root: Path, pkg: PackageDef, *, purge: bool) -> None:
    """Remove the package's files; ``remove`` keeps a ``config-files`` stanza, ``purge`` drops it."""
    for rel in pkg.files:
        (root / rel).unlink(missing_ok=True)
    for unit in pkg.units:
        (root / UNIT_DIR / unit.name).unlink(missing_ok=True)
    if pkg.module_files is not None:
        kmodules.remove_module_files(root, [m.name for m in pkg.modules()])
    stanzas = read_status(root)
    if purge:
        stanzas.pop(pkg.name, None)
    elif pkg.name in stanzas:
        stanzas[pkg.name].fields["Status"] = "deinstall ok config-files"
    write_status(root, stanzas.values())


def enable_link(root: Path, unit: str) -> Path:
    return root / WANTS_DIR / unit
