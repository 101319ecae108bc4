"""Make a whole emulated host from a fixture name or a :class:`HostSpec`: kernel, packages, services, VMs.

The kernel half (:func:`gpumode.emulated.build.create_kernel_tree`) boots the hardware into the spec's
driver state; this adds what userspace would have around it: the installed packages (dpkg database, unit
files, tools, the NVIDIA module files), the running services with their handles on the GPUs, driverctl's
override files, and the VMs, started so that they hold their devices.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from gpumode.emulated import packages, services
from gpumode.emulated.build import SpecError, create_kernel_tree
from gpumode.emulated.fixtures import get_fixture
from gpumode.emulated.hypervisor import EmulatedHypervisor
from gpumode.emulated.modules import ModuleFile
from gpumode.emulated.spec import HostSpec
from gpumode.host.root import Host
from gpumode.host.vms import HypervisorError, VmDevice


class CreateError(ValueError):
    """The host cannot be created (bad fixture, non-empty directory, impossible spec); nothing was made."""


def create_host(fixture: str | HostSpec, directory: str | Path) -> Host:
    """Create an emulated host under ``directory`` (missing or empty) and return it.

    ``fixture`` is a fixture name (see :data:`gpumode.emulated.fixtures.FIXTURES`) or a spec.
    """
    spec = get_fixture(fixture) if isinstance(fixture, str) else fixture
    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CreateError(f"{target} is not an empty directory; refusing to create an emulated host there")
    _check_userspace(spec)
    created = not target.exists()
    try:
        create_kernel_tree(spec, target, _module_files(spec))
        _install(spec, target)
    except CreateError:
        _clean(target, created)
        raise
    except (SpecError, HypervisorError, OSError) as exc:
        _clean(target, created)
        raise CreateError(f"cannot create {spec.name!r} in {target}: {exc}") from exc
    return Host(target)


def _check_userspace(spec: HostSpec) -> None:
    unknown = [p for p in spec.packages if p not in packages.CATALOGUE]
    if unknown:
        raise CreateError(
            f"host {spec.name!r}: unknown packages {unknown}; the catalogue has {sorted(packages.CATALOGUE)}"
        )
    flavours = {packages.CATALOGUE[p].flavour for p in spec.packages} - {""}
    if len(flavours) > 1:
        raise CreateError(f"host {spec.name!r}: packages of both nvidia flavours {sorted(flavours)} conflict")
    names = [vm.name for vm in spec.vms]
    if len(set(names)) != len(names):
        raise CreateError(f"host {spec.name!r}: VM names are not unique: {names}")


def _module_files(spec: HostSpec) -> list[ModuleFile]:
    return [m for name in spec.packages for m in packages.CATALOGUE[name].modules()]


def _install(spec: HostSpec, root: Path) -> None:
    packages.write_status(root, [])  # every Debian host has a status database, empty or not
    for name in spec.packages:
        pkg = packages.CATALOGUE[name]
        packages.unpack(root, pkg)
        for unit in pkg.units:
            services.enable(root, unit.name)
    (root / services.RUNTIME_DIR).mkdir(parents=True, exist_ok=True)
    for name in spec.services:
        rc, _out, err = services.start(root, name)
        if rc:
            raise CreateError(f"host {spec.name!r}: service {name} cannot start: {err.strip()}")
    overrides = root / "etc/driverctl.d"
    for address, driver in spec.driver_overrides.items():
        overrides.mkdir(parents=True, exist_ok=True)
        (overrides / f"pci-{address}").write_text(driver + "\n")
    hypervisor = EmulatedHypervisor(Host(root))
    for vm in spec.vms:
        devices = [VmDevice("pci", a) for a in vm.hostdevs] + [VmDevice("mdev", u) for u in vm.mdevs]
        hypervisor.define(vm.name, devices, str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{spec.hostname}.{vm.name}")))
    for vm in spec.vms:
        if vm.running:
            hypervisor.start(vm.name)


def _clean(target: Path, created: bool) -> None:
    """Leave the directory as it was (empty, or absent) after a failed create."""
    if not target.exists():
        return
    if created:
        shutil.rmtree(target, ignore_errors=True)
        return
    for child in target.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
