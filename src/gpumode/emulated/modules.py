"""Kernel module files of an emulated host: ``lib/modules/<release>/`` with ``modules.dep`` and small ``.ko``
files.

A ``.ko`` here is a text file: the line ``gpumode-emulated-module v1`` then ``key=value`` lines::

    name=vfio_pci                 module name (underscores)
    version=                      MODULE_VERSION, empty for most in-tree modules
    license=GPL                   MODULE_LICENSE ("NVIDIA" for the proprietary nvidia build, "Dual MIT/GPL"
    open) flavour=                      nvidia builds only: datacenter | vgpu
    build=                        nvidia builds only: proprietary | open
    size=16384                    what /proc/modules and lsmod print
    depends=vfio_pci_core,vfio    direct dependencies (modinfo -F depends)
    drivers=vfio-pci              the pci_driver names it registers (may differ from the module name)
    match=vfio-pci *:* override_only                      one line per id-table entry, see MatchRule
    match=snd_hda_intel *:* class=040300/ffffff
    flags=vfio-pci managed_dma,vfio                       driver capabilities: sriov_configure, managed_dma,
    vfio

``modules.dep`` lines have the real format (``kernel/drivers/vfio/pci/vfio-pci.ko: kernel/.../vfio-pci-core.ko
kernel/drivers/vfio/vfio.ko``, the transitive dependencies). The kernel half reads them on ``load_module``;
the userspace half adds and removes the NVIDIA files with :func:`install_module_files` /
:func:`remove_module_files` when a package is installed or removed (what ``dkms``/``depmod`` do on a real
host).
"""

from __future__ import annotations

import errno
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpumode.emulated.state import Driver, LoadedModule, MatchRule, load

MAGIC = "gpumode-emulated-module v1"
FLAGS = frozenset({"sriov_configure", "managed_dma", "vfio"})


@dataclass(slots=True)
class PciDriverDef:
    """A pci_driver a module registers."""

    name: str
    ids: list[MatchRule] = field(default_factory=list)
    flags: frozenset[str] = frozenset()


@dataclass(slots=True)
class ModuleFile:
    """One ``.ko`` file: where it lives under ``lib/modules/<release>/`` and what it declares."""

    path: str  # relative to lib/modules/<release>/, e.g. "kernel/drivers/vfio/pci/vfio-pci.ko"
    name: str
    version: str = ""
    license: str = "GPL"
    flavour: str = ""
    build: str = ""
    size: int = 16384
    depends: tuple[str, ...] = ()
    drivers: tuple[PciDriverDef, ...] = ()

    def render(self) -> str:
        lines = [
            MAGIC,
            f"name={self.name}",
            f"version={self.version}",
            f"license={self.license}",
            f"flavour={self.flavour}",
            f"build={self.build}",
            f"size={self.size}",
            f"depends={','.join(self.depends)}",
            f"drivers={','.join(d.name for d in self.drivers)}",
        ]
        for drv in self.drivers:
            lines += [f"match={drv.name} {format_rule(rule)}" for rule in drv.ids]
            if drv.flags:
                lines.append(f"flags={drv.name} {','.join(sorted(drv.flags))}")
        return "\n".join(lines) + "\n"

    def loaded(self) -> LoadedModule:
        """The module as the kernel holds it once loaded."""
        return LoadedModule(
            name=self.name,
            version=self.version,
            license=self.license,
            flavour=self.flavour,
            build=self.build,
            size=self.size,
            depends=list(self.depends),
            drivers=[d.name for d in self.drivers],
        )

    def pci_drivers(self) -> list[Driver]:
        return [
            Driver(
                name=d.name,
                module=self.name,
                ids=list(d.ids),
                sriov_configure="sriov_configure" in d.flags,
                managed_dma="managed_dma" in d.flags,
                vfio="vfio" in d.flags,
            )
            for d in self.drivers
        ]


class ModuleFormatError(ValueError):
    """A ``.ko`` file of the emulated host is not in the expected format."""


def module_name(path: str) -> str:
    """``kernel/drivers/vfio/pci/vfio-pci.ko`` → ``vfio_pci`` (the kernel's own rule)."""
    base = path.rsplit("/", 1)[-1]
    for suffix in (".ko.zst", ".ko.xz", ".ko"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base.replace("-", "_")


def _hex_or_any(text: str) -> int | None:
    return None if text == "*" else int(text, 16)


def parse_rule(text: str) -> MatchRule:
    """``VVVV:DDDD [sub=SV:SD] [class=CCCCCC/MMMMMM] [override_only]`` (``*`` = any)."""
    parts = text.split()
    if not parts or ":" not in parts[0]:
        raise ModuleFormatError(f"bad match rule {text!r}: expected VENDOR:DEVICE first")
    vendor, device = parts[0].split(":", 1)
    rule = MatchRule(vendor=_hex_or_any(vendor), device=_hex_or_any(device))
    for part in parts[1:]:
        if part == "override_only":
            rule.override_only = True
        elif part.startswith("sub="):
            sv, sd = part[4:].split(":", 1)
            rule.subvendor, rule.subdevice = _hex_or_any(sv), _hex_or_any(sd)
        elif part.startswith("class="):
            cc, _, mask = part[6:].partition("/")
            rule.class_code, rule.class_mask = int(cc, 16), int(mask or "ffffff", 16)
        else:
            raise ModuleFormatError(f"bad match rule {text!r}: unknown part {part!r}")
    return rule


def format_rule(rule: MatchRule) -> str:
    def hx(value: int | None) -> str:
        return "*" if value is None else f"{value:04x}"

    out = f"{hx(rule.vendor)}:{hx(rule.device)}"
    if rule.subvendor is not None or rule.subdevice is not None:
        out += f" sub={hx(rule.subvendor)}:{hx(rule.subdevice)}"
    if rule.class_mask:
        out += f" class={rule.class_code:06x}/{rule.class_mask:06x}"
    if rule.override_only:
        out += " override_only"
    return out


def parse_module_file(path: str, text: str) -> ModuleFile:
    """Parse a ``.ko`` of the emulated host; raises :class:`ModuleFormatError` naming what is wrong."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != MAGIC:
        raise ModuleFormatError(f"{path}: not an emulated module (first line must be {MAGIC!r})")
    scalars: dict[str, str] = {}
    matches: list[tuple[str, str]] = []
    flags: dict[str, frozenset[str]] = {}
    for line in lines[1:]:
        if not line.strip() or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ModuleFormatError(f"{path}: line {line!r} is not key=value")
        if key == "match":
            drv, _, rule = value.partition(" ")
            matches.append((drv, rule))
        elif key == "flags":
            drv, _, flag_list = value.partition(" ")
            wanted = frozenset(n for n in flag_list.split(",") if n)
            if wanted - FLAGS:
                raise ModuleFormatError(f"{path}: unknown driver flags {sorted(wanted - FLAGS)}")
            flags[drv] = wanted
        else:
            scalars[key] = value
    if "name" not in scalars:
        raise ModuleFormatError(f"{path}: no name=")
    names = [d for d in scalars.get("drivers", "").split(",") if d]
    drivers = tuple(
        PciDriverDef(n, [parse_rule(r) for d, r in matches if d == n], flags.get(n, frozenset()))
        for n in names
    )
    unknown = {d for d, _ in matches} - set(names)
    if unknown:
        raise ModuleFormatError(f"{path}: match= for drivers not in drivers=: {sorted(unknown)}")
    return ModuleFile(
        path=path,
        name=scalars["name"],
        version=scalars.get("version", ""),
        license=scalars.get("license", "GPL"),
        flavour=scalars.get("flavour", ""),
        build=scalars.get("build", ""),
        size=int(scalars.get("size", "16384")),
        depends=tuple(d for d in scalars.get("depends", "").split(",") if d),
        drivers=drivers,
    )


# --- the in-tree modules of a distro kernel -----------------------------------------------------------------


def _drv(name: str, *rules: str, flags: Iterable[str] = ()) -> PciDriverDef:
    return PciDriverDef(name, [parse_rule(r) for r in rules], frozenset(flags))


def _mod(path: str, *depends: str, drivers: Sequence[PciDriverDef] = (), size: int = 16384) -> ModuleFile:
    return ModuleFile(
        path=path, name=module_name(path), depends=tuple(depends), drivers=tuple(drivers), size=size
    )


IN_TREE_MODULES: tuple[ModuleFile, ...] = (
    _mod("kernel/virt/lib/irqbypass.ko"),
    _mod("kernel/drivers/vfio/vfio.ko", size=69632),
    _mod("kernel/drivers/vfio/vfio_iommu_type1.ko", "vfio", size=49152),
    _mod("kernel/drivers/vfio/pci/vfio-pci-core.ko", "vfio", "irqbypass", size=94208),
    _mod(
        "kernel/drivers/vfio/pci/vfio-pci.ko",
        "vfio_pci_core",
        "vfio",
        drivers=[_drv("vfio-pci", "*:* override_only", flags=("managed_dma", "vfio"))],
    ),
    _mod("kernel/drivers/vfio/mdev/mdev.ko", size=20480),
    _mod("kernel/drivers/pci/pci-stub.ko", drivers=[_drv("pci-stub", flags=("managed_dma",))]),
    _mod("kernel/drivers/pci/pci-pf-stub.ko", drivers=[_drv("pci-pf-stub", flags=("sriov_configure",))]),
    _mod("kernel/sound/core/snd.ko", size=135168),
    _mod("kernel/sound/hda/snd-hda-core.ko", "snd", size=139264),
    _mod("kernel/sound/pci/hda/snd-hda-codec.ko", "snd_hda_core", "snd", size=204800),
    _mod(
        "kernel/sound/pci/hda/snd-hda-intel.ko",
        "snd_hda_codec",
        "snd_hda_core",
        "snd",
        drivers=[_drv("snd_hda_intel", "*:* class=040300/ffffff", "*:* class=040100/ffff00")],
        size=61440,
    ),
    _mod("kernel/drivers/usb/host/xhci-pci.ko", drivers=[_drv("xhci_hcd", "*:* class=0c0330/ffffff")]),
    _mod("kernel/drivers/nvme/host/nvme-core.ko", size=200704),
    # nvme_pci_sriov_configure: an NVMe PF enables VFs through sriov_numvfs
    _mod(
        "kernel/drivers/nvme/host/nvme.ko",
        "nvme_core",
        drivers=[_drv("nvme", "*:* class=010802/ffffff", flags=("sriov_configure",))],
    ),
    _mod("kernel/drivers/ata/libahci.ko", size=53248),
    _mod("kernel/drivers/ata/ahci.ko", "libahci", drivers=[_drv("ahci", "*:* class=010601/ffffff")]),
    _mod(
        "kernel/drivers/net/ethernet/mellanox/mlx5/core/mlx5_core.ko",
        drivers=[_drv("mlx5_core", "15b3:* class=020000/ff0000", flags=("sriov_configure",))],
        size=2215936,
    ),
    # 82574L (QEMU's e1000e) of e1000e's much longer table
    _mod(
        "kernel/drivers/net/ethernet/intel/e1000e/e1000e.ko",
        drivers=[_drv("e1000e", "8086:10d3")],
        size=364544,
    ),
    _mod(
        "kernel/drivers/net/ethernet/intel/igb/igb.ko",
        drivers=[_drv("igb", "8086:1521", "8086:1533", "8086:1537", "8086:10c9")],
        size=290816,
    ),
    _mod(
        "kernel/drivers/net/ethernet/intel/ixgbe/ixgbe.ko",
        drivers=[_drv("ixgbe", "8086:10fb", "8086:1528", "8086:1563", flags=("sriov_configure",))],
        size=442368,
    ),
    _mod(
        "kernel/drivers/net/ethernet/intel/ixgbevf/ixgbevf.ko",
        drivers=[_drv("ixgbevf", "8086:10ed", "8086:1515", "8086:1565")],
    ),
    _mod(
        "kernel/drivers/net/ethernet/intel/i40e/i40e.ko",
        drivers=[_drv("i40e", "8086:1572", "8086:158b", "8086:1583", flags=("sriov_configure",))],
        size=565248,
    ),
    _mod("kernel/drivers/net/ethernet/intel/iavf/iavf.ko", drivers=[_drv("iavf", "8086:154c", "8086:1889")]),
    _mod(
        "kernel/drivers/i2c/busses/i2c-nvidia-gpu.ko",
        drivers=[_drv("nvidia-gpu", "10de:* class=0c8000/ffffff")],
    ),
    _mod("kernel/drivers/gpu/drm/drm.ko", size=716800),
    _mod("kernel/drivers/gpu/drm/drm_kms_helper.ko", "drm", size=270336),
    _mod(
        "kernel/drivers/gpu/drm/nouveau/nouveau.ko",
        "drm_kms_helper",
        "drm",
        drivers=[_drv("nouveau", "10de:* class=030000/ff0000")],
        size=3096576,
    ),
    # the Bochs/QEMU display (drivers/gpu/drm/tiny/bochs.c: ids 1234:1111 and 4321:1111, driver "bochs-drm")
    _mod(
        "kernel/drivers/gpu/drm/tiny/bochs.ko",
        "drm_kms_helper",
        "drm",
        drivers=[_drv("bochs-drm", "1234:1111", "4321:1111")],
        size=20480,
    ),
    _mod(
        "kernel/drivers/gpu/drm/ast/ast.ko",
        "drm_kms_helper",
        "drm",
        drivers=[_drv("ast", "1a03:2000", "1a03:2010")],
        size=106496,
    ),
)
"""What a stock distro kernel ships, enough for the devices of our fixtures. ``pcieport`` is built in."""

BUILTIN_DRIVERS: tuple[Driver, ...] = (
    Driver(name="pcieport", module=None, ids=[parse_rule("*:* class=060400/ffff00")], managed_dma=True),
)


def nvidia_module_files(flavour: str, version: str, *, open_build: bool = False) -> list[ModuleFile]:
    """The ``.ko`` files a NVIDIA driver package installs (DKMS puts them under ``updates/dkms/``).

    ``flavour`` is ``"datacenter"`` (nvidia, nvidia_uvm, nvidia_modeset, nvidia_drm) or ``"vgpu"`` (nvidia,
    nvidia_vgpu_vfio). Both builds install ``nvidia.ko`` at the same path: there is only one ``nvidia``.
    """
    if flavour not in ("datacenter", "vgpu"):
        raise ValueError(f"unknown NVIDIA driver flavour {flavour!r} (expected datacenter or vgpu)")
    license_ = "Dual MIT/GPL" if open_build else "NVIDIA"
    build = "open" if open_build else "proprietary"

    def nv(name: str, *depends: str, size: int, drivers: Sequence[PciDriverDef] = ()) -> ModuleFile:
        return ModuleFile(
            path=f"updates/dkms/{name.replace('_', '-')}.ko",
            name=name,
            version=version,
            license=license_,
            flavour=flavour,
            build=build,
            size=size,
            depends=tuple(depends),
            drivers=tuple(drivers),
        )

    core = nv(
        "nvidia",
        size=62783488 if flavour == "datacenter" else 56573952,
        drivers=[_drv("nvidia", "10de:* class=030000/ff0000", "10de:* class=068000/ffffff")],
    )
    if flavour == "vgpu":
        return [core, nv("nvidia_vgpu_vfio", "nvidia", "mdev", "vfio_pci_core", "vfio", size=90112)]
    return [
        core,
        nv("nvidia_modeset", "nvidia", size=1560576),
        nv("nvidia_uvm", "nvidia", size=4775936),
        nv("nvidia_drm", "nvidia_modeset", "drm_kms_helper", "drm", size=122880),
    ]


# --- lib/modules/<release>/ on disk -------------------------------------------------------------------------


def modules_dir(root: Path, release: str) -> Path:
    return root / "lib" / "modules" / release


def read_modules_dep(root: Path, release: str) -> dict[str, tuple[str, list[str]]]:
    """``modules.dep`` as ``{module name: (path, [dependency paths])}``; missing file → empty."""
    try:
        text = (modules_dir(root, release) / "modules.dep").read_text()
    except FileNotFoundError:
        return {}
    out: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        if ":" not in line:
            continue
        path, _, deps = line.partition(":")
        out[module_name(path.strip())] = (path.strip(), deps.split())
    return out


def read_module(
    root: Path, release: str, name: str, index: dict[str, tuple[str, list[str]]] | None = None
) -> ModuleFile:
    """The ``.ko`` of a known module; raises ``OSError(ENOENT)`` like modprobe when it is not in
    modules.dep. ``index``: :func:`read_modules_dep`, when the caller reads many modules."""
    name = name.replace("-", "_")
    entry = (read_modules_dep(root, release) if index is None else index).get(name)
    if entry is None:
        raise FileNotFoundError(errno.ENOENT, f"Module {name} not found in directory /lib/modules/{release}")
    path = modules_dir(root, release) / entry[0]
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"module file missing for {name}", entry[0]) from None
    try:
        return parse_module_file(entry[0], text)
    except ModuleFormatError as exc:
        raise OSError(errno.ENOEXEC, f"Exec format error ({exc})", entry[0]) from None


def known_modules(root: Path, release: str) -> list[ModuleFile]:
    """Every module listed in ``modules.dep`` whose file parses (what ``modinfo``/``modprobe`` can see)."""
    index = read_modules_dep(root, release)
    out = []
    for name in index:
        try:
            out.append(read_module(root, release, name, index))
        except OSError:
            continue
    return out


def _write_index(root: Path, release: str, files: dict[str, ModuleFile]) -> None:
    """Rewrite modules.dep (transitive deps, nearest first) and modules.alias from the module files."""
    by_name = files

    def closure(name: str, seen: list[str]) -> list[str]:
        for dep in by_name[name].depends if name in by_name else ():
            if dep not in seen and dep in by_name:
                seen.append(dep)
                closure(dep, seen)
        return seen

    dep_lines = []
    alias_lines = []
    for name in sorted(by_name):
        mod = by_name[name]
        deps = " ".join(by_name[d].path for d in closure(name, []))
        dep_lines.append(f"{mod.path}:{' ' + deps if deps else ''}")
        for drv in mod.drivers:
            alias_lines += [
                f"alias {_modalias_glob(rule)} {name}" for rule in drv.ids if not rule.override_only
            ]
    mdir = modules_dir(root, release)
    (mdir / "modules.dep").write_text("\n".join(dep_lines) + "\n")
    (mdir / "modules.alias").write_text(
        "# Aliases extracted from modules themselves.\n" + "\n".join(alias_lines) + "\n"
    )


def _modalias_glob(rule: MatchRule) -> str:
    def part(value: int | None) -> str:
        return "*" if value is None else f"{value:08X}"

    out = f"pci:v{part(rule.vendor)}d{part(rule.device)}sv{part(rule.subvendor)}sd{part(rule.subdevice)}"
    bc, sc, pi = (rule.class_code >> 16) & 0xFF, (rule.class_code >> 8) & 0xFF, rule.class_code & 0xFF
    mask = rule.class_mask
    out += f"bc{bc:02X}" if mask & 0xFF0000 else "bc*"
    out += f"sc{sc:02X}" if mask & 0x00FF00 else "sc*"
    out += f"i{pi:02X}" if mask & 0x0000FF else "i*"
    return out


def _release(root: Path) -> str:
    """The running kernel's release, from the emulated kernel's state (``uname -r``)."""
    return load(root).kernel_release


def _current_files(root: Path, release: str) -> dict[str, ModuleFile]:
    return {m.name: m for m in known_modules(root, release)}


def install_module_files(root: Path, files: Sequence[ModuleFile], release: str | None = None) -> None:
    """Write ``.ko`` files and refresh ``modules.dep``/``modules.alias`` (dkms install + depmod).

    A file for a module name that already exists replaces it (installing the vGPU build replaces the
    data-center
    ``nvidia.ko``). Loaded modules are not affected until they are unloaded and loaded again.
    """
    release = release or _release(root)
    current = _current_files(root, release)
    mdir = modules_dir(root, release)
    for mod in files:
        old = current.get(mod.name)
        if old is not None and old.path != mod.path:
            (mdir / old.path).unlink(missing_ok=True)
        target = mdir / mod.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(mod.render())
        current[mod.name] = mod
    _write_index(root, release, current)


def remove_module_files(root: Path, names: Iterable[str], release: str | None = None) -> None:
    """Delete module files by module name and refresh the index (dkms remove + depmod). Unknown names are
    skipped."""
    release = release or _release(root)
    current = _current_files(root, release)
    mdir = modules_dir(root, release)
    for name in names:
        mod = current.pop(name.replace("-", "_"), None)
        if mod is not None:
            (mdir / mod.path).unlink(missing_ok=True)
    _write_index(root, release, current)
