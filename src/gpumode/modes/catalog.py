"""The driver catalog: how each driver flavour is installed, run and removed; the vGPU types of each GPU.

The planner needs these facts before the host can show them (a host without the vGPU manager has no
``mdev_supported_types`` to read), so they live in a versioned YAML file (``data/catalog.yaml``, schema in
``docs/catalog.md``) that an operator can replace with their own. Loading validates everything up front and
rejects unknown keys, so a typo fails at load with the file, the key path and the problem, never halfway
through a mode switch.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpumode.domain import Flavour
from gpumode.yamlfile import Node, parse_yaml, read_text

CATALOG_VERSION = "v1"

# Every action the planner emits (docs/plan-steps.md); the catalog's ``estimates`` may only name these.
ACTIONS = (
    "vm.shutdown",
    "vm.detach_device",
    "vgpu.remove",
    "sriov.disable",
    "gpu.release",
    "bind.vfio",
    "service.stop",
    "module.unload",
    "driver.remove",
    "driver.install",
    "module.load",
    "service.start",
    "command.run",
    "bind.host",
    "sriov.enable",
    "vgpu.resolve",
    "vgpu.create",
    "cloud.register_cards",
    "cloud.deploy_env",
)

Condition = Literal["always", "nvswitch"]
VgpuInterface = Literal["mdev", "vendor"]
InstallerKind = Literal["apt", "run"]

# "10de:25b6" (any subsystem) or "10de:25b6:10de:157e" (that board only); a bare "25b6" means vendor 10de
_MODEL_KEY = re.compile(r"^(?:([0-9a-f]{4}):)?([0-9a-f]{4})(?::([0-9a-f]{4}):([0-9a-f]{4}))?$")
NVIDIA_VENDOR_ID = 0x10DE
_KERNEL_VERSION = re.compile(r"^(\d+)\.(\d+)")
_BRANCH = re.compile(r"^(\d+)\.")


# --- the catalog --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PackageSpec:
    name: str
    when: Condition = "always"
    keep_on_remove: bool = False  # not part of the driver (container toolkit): stays when the flavour goes


@dataclass(frozen=True, slots=True)
class InstallerSpec:
    kind: InstallerKind
    packages: tuple[PackageSpec, ...] = ()  # apt
    command: tuple[str, ...] = ()  # run: installer argv
    remove_command: tuple[str, ...] = ()  # run: uninstall argv
    detect_path: str | None = None  # run: exists exactly while installed


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    unit: str  # always with its type suffix: "nvidia-persistenced.service"
    when: Condition = "always"
    holds_gpus: bool = True  # keeps /dev/nvidia* open: must stop before a GPU is released or gets VFs


@dataclass(frozen=True, slots=True)
class CommandSpec:
    name: str
    argv: tuple[str, ...]
    undo_argv: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class FlavourSpec:
    flavour: Flavour
    version: str
    installer: InstallerSpec
    modules: tuple[str, ...]  # load order
    services: tuple[ServiceSpec, ...]  # start order
    post_install: tuple[CommandSpec, ...] = ()
    sriov_manage: str | None = None  # path of NVIDIA's sriov-manage (vGPU flavour)

    def packages(self, *, nvswitch: bool) -> list[PackageSpec]:
        return [p for p in self.installer.packages if _holds(p.when, nvswitch)]

    def units(self, *, nvswitch: bool) -> list[str]:
        return [s.unit for s in self.services if _holds(s.when, nvswitch)]


@dataclass(frozen=True, slots=True)
class VgpuType:
    id: int  # NVML type id: mdev type "nvidia-<id>", vendor current_vgpu_type <id>
    name: str  # "NVIDIA L40S-4Q"
    framebuffer_mib: int
    max_instances: int  # per physical GPU

    @property
    def mdev_type(self) -> str:
        return f"nvidia-{self.id}"


VgpuParent = Literal["pf", "vf"]
ModelKey = tuple[int, int, int | None, int | None]  # vendor, device, subsystem vendor, subsystem device


@dataclass(frozen=True, slots=True)
class GpuModel:
    device: int  # PCI device id
    name: str
    alias: str  # default passthrough alias
    sriov_vfs: int = 0  # 0: no SR-IOV
    vgpu_interface: VgpuInterface | None = None  # None: no vGPU
    vgpu_types: tuple[VgpuType, ...] = ()
    vendor: int = NVIDIA_VENDOR_ID
    subsystem: tuple[int, int] | None = None  # None: every board with this device id
    parent: VgpuParent | None = None  # None: on the VFs when the model has SR-IOV, else on the PF

    @property
    def vgpu_parent(self) -> VgpuParent | None:
        """Where vGPUs live: on the PF (Turing mdev, even on a T4 that has an SR-IOV capability) or on the
        VFs (Ampere mdev, vendor interface)."""
        if self.vgpu_interface is None:
            return None
        if self.parent is not None:
            return self.parent
        return "vf" if self.sriov_vfs else "pf"

    @property
    def key(self) -> ModelKey:
        sub = self.subsystem
        return (self.vendor, self.device, sub[0] if sub else None, sub[1] if sub else None)


@dataclass(frozen=True, slots=True)
class InterfaceRule:
    """What a vGPU manager branch exposes on a kernel, whatever the model (cited in the catalog)."""

    min_branch: int
    min_kernel: tuple[int, int]
    interface: VgpuInterface
    source: str


def driver_branch(version: str | None) -> int | None:
    """The branch of an NVIDIA driver version: ``580`` for ``580.65.05``; ``None`` when unreadable."""
    match = _BRANCH.match(version or "")
    return int(match.group(1)) if match else None


def kernel_version(release: str | None) -> tuple[int, int] | None:
    """(major, minor) of a kernel release string (``6.8.0-45-generic`` → (6, 8)); ``None`` if unreadable."""
    match = _KERNEL_VERSION.match(release or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True, slots=True)
class Catalog:
    source: str
    flavours: Mapping[Flavour, FlavourSpec]
    models: Mapping[ModelKey, GpuModel]
    estimates: Mapping[str, float] = field(default_factory=dict)
    interface_rules: tuple[InterfaceRule, ...] = ()
    vm_shutdown_timeout_s: float = 120.0
    default_estimate_s: float = 1.0

    def flavour(self, flavour: Flavour) -> FlavourSpec:
        return self.flavours[flavour]

    def model(
        self, device: int, subsystem: tuple[int, int] | None = None, vendor: int = NVIDIA_VENDOR_ID
    ) -> GpuModel | None:
        """The board with these ids: the entry for its subsystem ids first, else the one for every board
        with that device id. One PCI id can be two boards (10de:25b6 is the A2 and the A16), so a board
        whose subsystem the catalog does not list gets no other board's vGPU types."""
        if subsystem is not None:
            exact = self.models.get((vendor, device, subsystem[0], subsystem[1]))
            if exact is not None:
                return exact
        return self.models.get((vendor, device, None, None))

    def predicted_interface(
        self, model: GpuModel, branch: int | None, kernel: str | None
    ) -> tuple[VgpuInterface, VgpuParent] | None:
        """Which vGPU interface ``model`` will expose under vGPU manager ``branch`` on ``kernel``, before the
        manager is loaded: the first matching :class:`InterfaceRule`, else the model's own entry. The vendor
        interface lives on VFs, so a model without SR-IOV then offers no vGPU at all (``None``)."""
        if model.vgpu_interface is None or model.vgpu_parent is None:
            return None
        release = kernel_version(kernel)
        for rule in self.interface_rules:
            if branch is None or release is None:
                break  # unknown branch or kernel: nothing better than the model's entry is known
            if branch >= rule.min_branch and release >= rule.min_kernel:
                if rule.interface == "vendor":
                    return ("vendor", "vf") if model.sriov_vfs else None
                return "mdev", model.vgpu_parent
        return model.vgpu_interface, model.vgpu_parent

    def estimate(self, action: str) -> float:
        return self.estimates.get(action, self.default_estimate_s)

    def flavour_of_package(self, name: str) -> Flavour | None:
        for spec in self.flavours.values():
            if any(p.name == name for p in spec.installer.packages):
                return spec.flavour
        return None


def _holds(when: Condition, nvswitch: bool) -> bool:
    return when == "always" or nvswitch


def load_catalog(path: str | Path | None = None) -> Catalog:
    """Load and validate a catalog file; ``None`` loads the one shipped with gpumode.

    The file is read every time (an operator's edit takes effect at the next switch), but parsing and
    validating it is the expensive part, so a text seen before gives back its (frozen) catalog."""
    return _parse_catalog_text(*read_text(path, "catalog.yaml"))


@functools.lru_cache(maxsize=8)
def _parse_catalog_text(source: str, text: str) -> Catalog:
    return parse_catalog(parse_yaml(source, text), source)


def parse_catalog(data: Any, source: str = "<catalog>") -> Catalog:
    top = Node(source, "", data).mapping(
        required=("version", "flavours", "gpu_models"),
        optional=("estimates", "vm_shutdown_timeout_s", "default_estimate_s", "vgpu_interface_rules"),
    )
    if top["version"].value != CATALOG_VERSION:
        raise top["version"].error(
            f"unsupported catalog version {top['version'].value!r} (this gpumode reads v1)"
        )
    flavours_node = top["flavours"].mapping(required=tuple(f.value for f in Flavour))
    flavours = {f: _flavour(f, flavours_node[f.value]) for f in Flavour}
    models: dict[ModelKey, GpuModel] = {}
    for key, node in top["gpu_models"].entries():
        match = _MODEL_KEY.match(key)
        if not match:
            raise node.error(
                "GPU model keys are quoted PCI ids in lowercase hex: 'vendor:device' (e.g. '10de:26b9') or "
                "'vendor:device:subsystem_vendor:subsystem_device' (e.g. '10de:25b6:10de:157e')"
            )
        vendor = int(match.group(1) or "10de", 16)
        subsystem = (int(match.group(3), 16), int(match.group(4), 16)) if match.group(3) else None
        model = _model(int(match.group(2), 16), node, vendor, subsystem)
        if model.key in models:
            raise node.error(f"duplicate GPU model {key!r}")
        models[model.key] = model
    rules = (
        tuple(_interface_rule(n) for n in top["vgpu_interface_rules"].items())
        if "vgpu_interface_rules" in top
        else ()
    )
    estimates: dict[str, float] = {}
    if "estimates" in top:
        for action, node in top["estimates"].entries():
            if action not in ACTIONS:
                raise node.error(f"unknown action {action!r} (known: {', '.join(ACTIONS)})")
            estimates[action] = node.number()
    return Catalog(
        source=source,
        flavours=flavours,
        models=models,
        estimates=estimates,
        interface_rules=rules,
        vm_shutdown_timeout_s=top["vm_shutdown_timeout_s"].number()
        if "vm_shutdown_timeout_s" in top
        else 120.0,
        default_estimate_s=top["default_estimate_s"].number() if "default_estimate_s" in top else 1.0,
    )


def _flavour(flavour: Flavour, node: Node) -> FlavourSpec:
    m = node.mapping(
        required=("version", "installer", "modules", "services"),
        optional=("post_install", "sriov_manage"),
    )
    modules = m["modules"].str_list()
    if not modules or modules[0] != "nvidia":
        raise m["modules"].error("must list the modules in load order, starting with 'nvidia'")
    services = tuple(_service(n) for n in m["services"].items())
    post = tuple(_command(n) for n in m["post_install"].items()) if "post_install" in m else ()
    sriov_manage = m["sriov_manage"].text() if "sriov_manage" in m else None
    if flavour is Flavour.VGPU and sriov_manage is None:
        raise node.error("missing key 'sriov_manage' (the vGPU flavour enables SR-IOV VFs with it)")
    return FlavourSpec(
        flavour=flavour,
        version=str(m["version"].text()),
        installer=_installer(m["installer"]),
        modules=tuple(n.replace("-", "_") for n in modules),
        services=services,
        post_install=post,
        sriov_manage=sriov_manage,
    )


def _installer(node: Node) -> InstallerSpec:
    kind = node.mapping(required=("kind",), optional=("packages", "command", "remove_command", "detect_path"))
    if kind["kind"].choice(("apt", "run")) == "apt":
        m = node.mapping(required=("kind", "packages"))
        packages = tuple(_package(n) for n in m["packages"].items())
        if not packages:
            raise m["packages"].error("an apt installer needs at least one package")
        return InstallerSpec(kind="apt", packages=packages)
    m = node.mapping(required=("kind", "command", "remove_command", "detect_path"))
    return InstallerSpec(
        kind="run",
        command=_argv(m["command"]),
        remove_command=_argv(m["remove_command"]),
        detect_path=m["detect_path"].text(),
    )


def _package(node: Node) -> PackageSpec:
    m = node.mapping(required=("name",), optional=("when", "keep_on_remove"))
    return PackageSpec(
        name=m["name"].text(),
        when=_condition(m["when"]) if "when" in m else "always",
        keep_on_remove=m["keep_on_remove"].flag() if "keep_on_remove" in m else False,
    )


def _service(node: Node) -> ServiceSpec:
    m = node.mapping(required=("name",), optional=("when", "holds_gpus"))
    name = m["name"].text()
    return ServiceSpec(
        unit=name if "." in name else f"{name}.service",
        when=_condition(m["when"]) if "when" in m else "always",
        holds_gpus=m["holds_gpus"].flag() if "holds_gpus" in m else True,
    )


def _command(node: Node) -> CommandSpec:
    m = node.mapping(required=("name", "argv"), optional=("undo_argv",))
    return CommandSpec(
        name=m["name"].text(),
        argv=_argv(m["argv"]),
        undo_argv=_argv(m["undo_argv"]) if "undo_argv" in m else None,
    )


def _argv(node: Node) -> tuple[str, ...]:
    argv = node.str_list()
    if not argv:
        raise node.error("a command needs at least the program name")
    return argv


def _condition(node: Node) -> Condition:
    return "nvswitch" if node.choice(("always", "nvswitch")) == "nvswitch" else "always"


def _interface_rule(node: Node) -> InterfaceRule:
    m = node.mapping(required=("min_branch", "min_kernel", "interface", "source"))
    kernel = kernel_version(m["min_kernel"].text())
    if kernel is None:
        raise m["min_kernel"].error("expected a kernel version such as '6.8'")
    interface: VgpuInterface = "mdev" if m["interface"].choice(("mdev", "vendor")) == "mdev" else "vendor"
    return InterfaceRule(m["min_branch"].integer(minimum=1), kernel, interface, m["source"].text())


def _model(
    device: int, node: Node, vendor: int = NVIDIA_VENDOR_ID, subsystem: tuple[int, int] | None = None
) -> GpuModel:
    m = node.mapping(required=("name", "alias"), optional=("sriov_vfs", "vgpu"))
    sriov_vfs = m["sriov_vfs"].integer() if "sriov_vfs" in m else 0
    interface: VgpuInterface | None = None
    parent: VgpuParent | None = None
    types: tuple[VgpuType, ...] = ()
    if "vgpu" in m:
        v = m["vgpu"].mapping(required=("interface", "types"), optional=("parent",))
        interface = "mdev" if v["interface"].choice(("mdev", "vendor")) == "mdev" else "vendor"
        if interface == "vendor" and not sriov_vfs:
            raise v["interface"].error("the vendor interface lives on SR-IOV VFs: set sriov_vfs")
        if "parent" in v:
            parent = "pf" if v["parent"].choice(("pf", "vf")) == "pf" else "vf"
            if parent == "vf" and not sriov_vfs:
                raise v["parent"].error("vGPUs on VFs need SR-IOV: set sriov_vfs")
            if parent == "pf" and interface == "vendor":
                raise v["parent"].error("the vendor interface lives on VFs, not on the PF")
        types = tuple(_vgpu_type(n) for n in v["types"].items())
        if not types:
            raise v["types"].error("list at least one vGPU type, or drop 'vgpu'")
        seen: set[int] = set()
        for n, t in zip(v["types"].items(), types, strict=True):
            if t.id in seen:
                raise n.error(f"duplicate vGPU type id {t.id}")
            seen.add(t.id)
    return GpuModel(
        device=device,
        name=m["name"].text(),
        alias=m["alias"].text(),
        sriov_vfs=sriov_vfs,
        vgpu_interface=interface,
        vgpu_types=types,
        vendor=vendor,
        subsystem=subsystem,
        parent=parent,
    )


def _vgpu_type(node: Node) -> VgpuType:
    m = node.mapping(required=("id", "name", "framebuffer_mib", "max_instances"))
    return VgpuType(
        id=m["id"].integer(minimum=1),
        name=m["name"].text(),
        framebuffer_mib=m["framebuffer_mib"].integer(minimum=1),
        max_instances=m["max_instances"].integer(minimum=1),
    )
