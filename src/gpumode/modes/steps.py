"""Step implementations: for each plan action, how to check it, apply it and undo it.

The contract for every action (target, params, apply, check, undo) is ``docs/plan-steps.md``, written with the
planner. Each implementation is a small class; ``check`` only reads, ``apply`` is a no-op when ``check`` holds
and
calls :meth:`StepContext.remember` with what undo needs *before* it changes anything, ``undo`` works from that
record and copes with a partial apply and with being run twice. The host operations themselves live in
``gpumode.host`` (bind, vgpu, driverops, the hypervisor); a step only decides which to call and what to
remember.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from gpumode.domain import Plan, Step, normalize_address
from gpumode.host import bind, driverops, sriov, vgpu
from gpumode.host.root import Host
from gpumode.host.vms import Hypervisor, Vm, VmDevice


class StepError(RuntimeError):
    """A step cannot run or did not take effect; the message names the step's action and target."""


@dataclass(slots=True)
class StepContext:
    """What a step sees while it runs: its own definition, its journal record, the plan, the hypervisor."""

    host: Host
    step: Step
    record: dict[str, Any]  # the journal's undo record of this step; survives a crash
    plan: Plan
    save: Callable[[], None]  # persist the journal (the runner's)
    hypervisor_factory: Callable[[], Hypervisor]

    @property
    def hypervisor(self) -> Hypervisor:
        return self.hypervisor_factory()

    @property
    def params(self) -> dict[str, Any]:
        return self.step.params

    def param(self, name: str) -> Any:
        try:
            return self.step.params[name]
        except KeyError:
            raise StepError(f"{self.step.action} {self.step.target}: missing parameter {name!r}") from None

    def remember(self, **values: Any) -> None:
        """Record what undo needs, durably, *before* acting. A value recorded by an earlier attempt is kept:
        it describes the host as it was before this plan touched it, which a retry can no longer see."""
        changed = False
        for key, value in values.items():
            if key not in self.record:
                self.record[key] = value
                changed = True
        if changed:
            self.save()


class StepImpl(Protocol):
    """An action's implementation. Two optional class attributes tune the runner (read with ``getattr``):
    ``verify = False`` for a step whose effect cannot be read back (the runner then trusts apply), and
    ``remembers_first = True`` for a step whose apply always calls ``ctx.remember`` before it changes anything
    (the runner then lets that save record the step as started, one fsync less per step)."""

    action: ClassVar[str]

    def check(self, host: Host, ctx: StepContext) -> bool:
        """Is the step's effect already visible on the host? Reads only."""
        ...

    def apply(self, host: Host, ctx: StepContext) -> None:
        """Make it so; a no-op when already done. Calls ``ctx.remember`` before changing anything."""
        ...

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        """Put back what ``record`` says apply changed; copes with a partial apply and a second run."""
        ...


class StepRegistry:
    """Action name -> implementation."""

    def __init__(self, impls: dict[str, StepImpl] | None = None) -> None:
        self._impls: dict[str, StepImpl] = dict(impls or {})

    def add(self, impl: StepImpl) -> None:
        self._impls[impl.action] = impl

    def get(self, action: str) -> StepImpl:
        try:
            return self._impls[action]
        except KeyError:
            raise StepError(f"no step implementation for action {action!r}") from None

    def actions(self) -> list[str]:
        return sorted(self._impls)


# --- helpers ------------------------------------------------------------------------------------------------


def _argv(ctx: StepContext, name: str) -> list[str]:
    value = ctx.param(name)
    if not isinstance(value, list) or not value or not all(isinstance(a, str) and a for a in value):
        raise StepError(
            f"{ctx.step.action} {ctx.step.target}: parameter {name!r} is not a command: {value!r}"
        )
    return value


def _exists(host: Host, address: str) -> bool:
    return bind.device_exists(host, address)


def _driver(host: Host, address: str) -> str | None:
    return bind.current_driver(host, address) if _exists(host, address) else None


def _vendor_type(host: Host, vf: str) -> int | None:
    """The VF's current vGPU type; None when the VF or its vendor interface is gone."""
    if not _exists(host, vf) or not vgpu.has_vendor_interface(host, vf):
        return None
    return vgpu.current_type(host, vf)


def _mdev_exists(host: Host, uuid: str) -> bool:
    return vgpu.mdev_exists(host, uuid)


def _vm(ctx: StepContext, name: str) -> Vm | None:
    return next((vm for vm in ctx.hypervisor.list_vms() if vm.name == name), None)


class _Base:
    verify: ClassVar[bool] = True
    remembers_first: ClassVar[bool] = True  # every apply below calls ctx.remember before it acts


# --- VMs ----------------------------------------------------------------------------------------------------


class VmShutdown(_Base):
    action: ClassVar[str] = "vm.shutdown"

    def check(self, host: Host, ctx: StepContext) -> bool:
        vm = _vm(ctx, ctx.step.target)
        return vm is None or not vm.running

    def apply(self, host: Host, ctx: StepContext) -> None:
        vm = _vm(ctx, ctx.step.target)
        if vm is None or not vm.running:
            return
        ctx.remember(was_running=True)
        ctx.hypervisor.shutdown(vm.name, timeout=float(ctx.params.get("timeout_s", 60.0)))

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        if record.get("was_running") and _vm(ctx, ctx.step.target) is not None:
            ctx.hypervisor.start(ctx.step.target)


class VmStart(_Base):
    """A VM the plan shut down that kept all its devices, started again once the host is switched."""

    action: ClassVar[str] = "vm.start"

    def check(self, host: Host, ctx: StepContext) -> bool:
        vm = _vm(ctx, ctx.step.target)
        return vm is None or vm.running

    def apply(self, host: Host, ctx: StepContext) -> None:
        if self.check(host, ctx):
            return
        ctx.remember(started=True)
        ctx.hypervisor.start(ctx.step.target)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        vm = _vm(ctx, ctx.step.target)
        if record.get("started") and vm is not None and vm.running:
            ctx.hypervisor.shutdown(vm.name, timeout=60.0)


class VmDetachDevice(_Base):
    action: ClassVar[str] = "vm.detach_device"

    def _device(self, ctx: StepContext) -> VmDevice:
        kind = ctx.param("kind")
        if kind not in ("pci", "mdev"):
            raise StepError(f"vm.detach_device {ctx.step.target}: unknown device kind {kind!r}")
        return VmDevice(kind, str(ctx.param("id")))

    def check(self, host: Host, ctx: StepContext) -> bool:
        vm = _vm(ctx, ctx.step.target)
        return vm is None or self._device(ctx) not in vm.devices

    def apply(self, host: Host, ctx: StepContext) -> None:
        if self.check(host, ctx):
            return
        device = self._device(ctx)
        # the journal must know the VM lost this device before the hypervisor forgets it
        ctx.remember(detached={"kind": device.kind, "id": device.id})
        ctx.hypervisor.detach_device(ctx.step.target, device)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        detached = record.get("detached")
        if detached and _vm(ctx, ctx.step.target) is not None:
            ctx.hypervisor.attach_device(ctx.step.target, VmDevice(detached["kind"], detached["id"]))


# --- vGPU devices and SR-IOV --------------------------------------------------------------------------------


class VgpuRemove(_Base):
    action: ClassVar[str] = "vgpu.remove"

    def check(self, host: Host, ctx: StepContext) -> bool:
        if ctx.param("interface") == "mdev":
            return not _mdev_exists(host, ctx.param("uuid"))
        return not _vendor_type(host, ctx.step.target)  # no vGPU, or the VF itself is gone

    def apply(self, host: Host, ctx: StepContext) -> None:
        if ctx.param("interface") == "mdev":
            uuid = ctx.param("uuid")
            ctx.remember(parent=ctx.step.target, type_id=ctx.param("type_id"), uuid=uuid)
            vgpu.remove_mdev(host, uuid)
        else:
            vf = ctx.step.target
            ctx.remember(vf=vf, type=vgpu.current_type(host, vf))
            vgpu.clear_vgpu_type(host, vf)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        if "uuid" in record:
            if not _mdev_exists(host, record["uuid"]):
                vgpu.create_mdev(host, record["parent"], record["type_id"], record["uuid"])
        elif record.get("type") and _vendor_type(host, record["vf"]) == 0:
            vgpu.set_vgpu_type(host, record["vf"], int(record["type"]))


class VgpuCreate(_Base):
    action: ClassVar[str] = "vgpu.create"

    def _parent(self, host: Host, ctx: StepContext) -> str | None:
        index = ctx.params.get("vf_index")
        return ctx.step.target if index is None else vgpu.virtfn(host, ctx.step.target, int(index))

    def check(self, host: Host, ctx: StepContext) -> bool:
        if ctx.param("interface") == "mdev":
            return _mdev_exists(host, ctx.param("uuid"))
        vf = self._parent(host, ctx)
        return vf is not None and _vendor_type(host, vf) == int(ctx.param("type"))

    def apply(self, host: Host, ctx: StepContext) -> None:
        parent = self._parent(host, ctx)
        if parent is None:
            raise StepError(
                f"vgpu.create {ctx.step.target}: VF {ctx.params.get('vf_index')} does not exist "
                "(SR-IOV disabled?)"
            )
        if ctx.param("interface") == "mdev":
            ctx.remember(uuid=ctx.param("uuid"))
            vgpu.create_mdev(host, parent, ctx.param("type_id"), ctx.param("uuid"))
        else:
            ctx.remember(vf=parent)
            vgpu.set_vgpu_type(host, parent, int(ctx.param("type")))

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        if "uuid" in record:
            vgpu.remove_mdev(host, record["uuid"])
        elif "vf" in record and _vendor_type(host, record["vf"]) == int(ctx.param("type")):
            vgpu.clear_vgpu_type(host, record["vf"])


class VgpuResolve:
    """``vgpu.resolve``: right after the vGPU manager came up, the host offers the planned type under the id
    and interface the plan took from the catalog. Changes nothing; fails before any vGPU is made otherwise."""

    action: ClassVar[str] = "vgpu.resolve"

    def _offered(self, host: Host, ctx: StepContext) -> vgpu.VgpuType:
        return vgpu.resolve_vgpu_type(host, ctx.step.target, str(ctx.param("name")))

    def check(self, host: Host, ctx: StepContext) -> bool:
        try:
            offered = self._offered(host, ctx)
        except (vgpu.VgpuError, OSError, ValueError):
            return False
        return offered.type_id == int(ctx.param("type")) and offered.interface == ctx.param("interface")

    def apply(self, host: Host, ctx: StepContext) -> None:
        where = f"vgpu.resolve {ctx.step.target}"
        name, planned, interface = ctx.param("name"), int(ctx.param("type")), ctx.param("interface")
        try:
            offered = self._offered(host, ctx)
        except vgpu.VgpuError as exc:
            raise StepError(f"{where}: the host does not offer {name}: {exc}; no vGPU was created") from exc
        if offered.interface != interface:
            raise StepError(
                f"{where}: the host offers {name} through the {offered.interface} interface, the plan (made "
                f"from the catalog before the vGPU manager was loaded) expected {interface}; no vGPU was "
                "created: plan again now that the host shows its types"
            )
        if offered.type_id != planned:
            raise StepError(
                f"{where}: the host's id for {name} is {offered.type_id}, the plan's (from the catalog) is "
                f"{planned}; no vGPU was created: correct the catalog, or plan again now that the host shows "
                "its types"
            )

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        return  # apply changes nothing


class _Sriov(_Base):
    """``sriov-manage -e|-d`` with gpumode's own repairs around it: an interrupted run of the tool leaves the
    PF on pci-pf-stub (or driverless) and its id in pci-pf-stub, which make every later run fail; those are
    repaired with kernel writes first (:func:`gpumode.host.sriov.settle`). When the tool is gone (removed with
    the vGPU manager, e.g. during the undo of a rollback) gpumode does the same dance itself."""

    enable: ClassVar[bool]

    def _enabled(self, host: Host, ctx: StepContext) -> bool:
        """The kernel's account: ``sriov_numvfs`` and as many present VFs (``virtfnN``) as it says."""
        pf = ctx.step.target
        count = vgpu.num_vfs(host, pf)
        present = [vf for vf in vgpu.list_vfs(host, pf) if _exists(host, vf)]
        if len(present) != count:
            raise StepError(f"{pf} reads sriov_numvfs={count} but has {len(present)} VF(s) present")
        return count > 0

    def check(self, host: Host, ctx: StepContext) -> bool:
        # VFs changed but the PF still on pci-pf-stub is sriov-manage cut off halfway: not done yet
        return self._enabled(host, ctx) == self.enable and not sriov.leftovers(host, ctx.step.target)

    def apply(self, host: Host, ctx: StepContext) -> None:
        pf = ctx.step.target
        vfs = vgpu.list_vfs(host, pf)
        drivers = {vf: _driver(host, vf) for vf in vfs}
        ctx.remember(num_vfs_before=vgpu.num_vfs(host, pf), vf_drivers=drivers)
        if not self.enable:
            vgpu.refuse_if_vfs_held(host, pf)  # disabling waits for every VF's users
        self._switch(host, ctx, "argv", self.enable)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        pf = ctx.step.target
        if "num_vfs_before" not in record or not _exists(host, pf):
            return
        was_enabled = record["num_vfs_before"] > 0
        if self._enabled(host, ctx) != was_enabled:
            if not was_enabled:
                vgpu.refuse_if_vfs_held(host, pf)
            self._switch(host, ctx, "undo_argv", was_enabled)
        else:
            _settle(host, pf)
        # sriov-manage unbinds the VFs before it touches the PF: a failure halfway leaves them driverless
        for vf, driver in (record.get("vf_drivers") or {}).items():
            if driver and _exists(host, vf) and _driver(host, vf) is None:
                bind.bind_driver(host, vf, driver)

    @staticmethod
    def _switch(host: Host, ctx: StepContext, argv_name: str, enable: bool) -> None:
        pf, argv = ctx.step.target, _argv(ctx, argv_name)
        _settle(host, pf)
        if "/" in argv[0] and not host.path(argv[0]).is_file():
            # the tool went with the vGPU manager: gpumode's own writes do what it would
            _sriov(lambda: sriov.set_num_vfs(host, pf, enable))
            return
        try:
            host.run(argv, check=True)
        finally:
            _settle(host, pf)  # the tool failed or was cut off halfway: give the PF back to nvidia


def _settle(host: Host, pf: str) -> None:
    _sriov(lambda: sriov.settle(host, pf))


def _sriov(action: Callable[[], object]) -> None:
    try:
        action()
    except sriov.SriovError as exc:
        raise StepError(str(exc)) from exc


class SriovEnable(_Sriov):
    action: ClassVar[str] = "sriov.enable"
    enable: ClassVar[bool] = True


class SriovDisable(_Sriov):
    action: ClassVar[str] = "sriov.disable"
    enable: ClassVar[bool] = False


# --- moving a GPU between drivers ---------------------------------------------------------------------------


class GpuRelease(_Base):
    action: ClassVar[str] = "gpu.release"

    def check(self, host: Host, ctx: StepContext) -> bool:
        return _driver(host, ctx.step.target) != str(ctx.param("driver"))

    def apply(self, host: Host, ctx: StepContext) -> None:
        gpu, driver = ctx.step.target, str(ctx.param("driver"))
        ctx.remember(driver=driver)
        if driver == "nvidia":
            bind.release_from_nvidia(host, gpu)
        else:
            bind.unbind(host, gpu, driver)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        driver = record.get("driver")
        gpu = ctx.step.target
        if not driver or not _exists(host, gpu) or _driver(host, gpu) is not None:
            return
        override = bind.driver_override(host, gpu)
        if (override is not None and override != driver) or not bind.driver_registered(host, driver):
            return  # the kernel would refuse; a later undo (bind.vfio's) or the module load rebinds it
        bind.bind_driver(host, gpu, driver)


class BindVfio(_Base):
    action: ClassVar[str] = "bind.vfio"

    def check(self, host: Host, ctx: StepContext) -> bool:
        gpu, persist = ctx.step.target, bool(ctx.params.get("persist", True))
        for member in bind.vfio_members(host, gpu):
            if bind.current_driver(host, member) != bind.VFIO_DRIVER:
                return False
            if bind.driver_override(host, member) != bind.VFIO_DRIVER:
                return False
            if persist and bind.persisted_override(host, member) != bind.VFIO_DRIVER:
                return False
        return True

    def apply(self, host: Host, ctx: StepContext) -> None:
        gpu = ctx.step.target
        ctx.remember(before={m: bind.current_driver(host, m) for m in bind.vfio_members(host, gpu)})
        bind.bind_to_vfio(host, gpu, persist=bool(ctx.params.get("persist", True)))

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        if "before" in record:
            bind.release_from_vfio(host, ctx.step.target, record["before"])


class BindHost(_Base):
    action: ClassVar[str] = "bind.host"

    def _drivers(self, ctx: StepContext) -> dict[str, str | None]:
        drivers = ctx.param("drivers")
        if not isinstance(drivers, dict) or ctx.step.target not in drivers:
            raise StepError(
                f"bind.host {ctx.step.target}: 'drivers' must map the GPU to its driver: {drivers!r}"
            )
        return {normalize_address(k): v for k, v in drivers.items()}

    def check(self, host: Host, ctx: StepContext) -> bool:
        gpu = ctx.step.target
        if _driver(host, gpu) != self._drivers(ctx)[gpu]:
            return False
        return not any(_vfio_traces(host, m) for m in bind.vfio_members(host, gpu))

    def apply(self, host: Host, ctx: StepContext) -> None:
        gpu, drivers = ctx.step.target, self._drivers(ctx)
        on_vfio = any(_vfio_traces(host, m) for m in bind.vfio_members(host, gpu))
        ctx.remember(found_vfio=on_vfio)
        if on_vfio:
            bind.release_from_vfio(host, gpu, drivers)
        elif _driver(host, gpu) is None:
            bind.probe(host, gpu)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        gpu = ctx.step.target
        if "found_vfio" not in record or not _exists(host, gpu):
            return
        if record["found_vfio"]:
            bind.bind_to_vfio(host, gpu, persist=True)
            return
        driver = self._drivers(ctx)[gpu]
        if driver is not None and _driver(host, gpu) == driver:
            if driver == "nvidia":
                bind.release_from_nvidia(host, gpu)
            else:
                bind.unbind(host, gpu, driver)


def _vfio_traces(host: Host, address: str) -> bool:
    """Is any part of a vfio-pci binding left on this function: the binding, the override or driverctl's
    file?"""
    return (
        bind.current_driver(host, address) == bind.VFIO_DRIVER
        or bind.driver_override(host, address) == bind.VFIO_DRIVER
        or bind.persisted_override(host, address) == bind.VFIO_DRIVER
    )


# --- driver: services, modules, packages, commands ----------------------------------------------------------


class ServiceStart(_Base):
    action: ClassVar[str] = "service.start"

    def check(self, host: Host, ctx: StepContext) -> bool:
        return driverops.service_active(host, ctx.step.target)

    def apply(self, host: Host, ctx: StepContext) -> None:
        ctx.remember(started=True)
        driverops.start_service(host, ctx.step.target)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        if record.get("started"):
            # a start cut off halfway may have left the daemon up with the unit not (yet) active
            driverops.stop_service(host, ctx.step.target, even_if_inactive=True)


class ServiceStop(_Base):
    action: ClassVar[str] = "service.stop"

    def check(self, host: Host, ctx: StepContext) -> bool:
        return not driverops.service_active(host, ctx.step.target)

    def apply(self, host: Host, ctx: StepContext) -> None:
        ctx.remember(stopped=True)
        driverops.stop_service(host, ctx.step.target)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        if record.get("stopped"):
            driverops.start_service(host, ctx.step.target)


class ModuleLoad(_Base):
    action: ClassVar[str] = "module.load"

    def check(self, host: Host, ctx: StepContext) -> bool:
        return driverops.module_loaded(host, ctx.step.target)

    def apply(self, host: Host, ctx: StepContext) -> None:
        ctx.remember(loaded=True)
        driverops.load_module(host, ctx.step.target)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        if record.get("loaded"):
            driverops.unload_module(host, ctx.step.target)


class ModuleUnload(_Base):
    action: ClassVar[str] = "module.unload"

    def check(self, host: Host, ctx: StepContext) -> bool:
        return not driverops.module_loaded(host, ctx.step.target)

    def apply(self, host: Host, ctx: StepContext) -> None:
        ctx.remember(unloaded=True)
        driverops.unload_module(host, ctx.step.target)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        if record.get("unloaded"):
            driverops.load_module(host, ctx.step.target)


class _Driver(_Base):
    """``driver.install`` and ``driver.remove``: packages through the installer, or a ``.run`` installer."""

    install: ClassVar[bool]

    def _installed(self, host: Host, ctx: StepContext) -> bool:
        """For install: is everything there? For remove: is anything left?"""
        if ctx.param("installer") == "run":
            return _root_path_exists(host, str(ctx.param("detect_path")))
        present = [driverops.package_installed(host, p) for p in ctx.param("packages")]
        return all(present) if self.install else any(present)

    def check(self, host: Host, ctx: StepContext) -> bool:
        return self._installed(host, ctx) == self.install

    def apply(self, host: Host, ctx: StepContext) -> None:
        packages: list[str] = list(ctx.param("packages"))
        if ctx.param("installer") == "run":
            ctx.remember(changed=True)
            host.run(_argv(ctx, "command" if self.install else "remove_command"), check=True)
            return
        # only what this step changes is undone: a package that was already there (or absent) stays so
        ctx.remember(changed=[p for p in packages if driverops.package_installed(host, p) != self.install])
        self._packages(host, ctx, packages, install=self.install)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        changed = record.get("changed")
        if not changed:
            return
        if ctx.param("installer") == "run":
            if self._installed(host, ctx) == self.install:
                host.run(_argv(ctx, "remove_command" if self.install else "command"), check=True)
            return
        self._packages(host, ctx, list(changed), install=not self.install)

    @staticmethod
    def _packages(host: Host, ctx: StepContext, packages: Sequence[str], *, install: bool) -> None:
        installer = str(ctx.params.get("installer") or "apt")
        if install:
            driverops.install_packages(host, packages, installer)
        else:
            driverops.remove_packages(host, packages, installer)


class DriverInstall(_Driver):
    action: ClassVar[str] = "driver.install"
    install: ClassVar[bool] = True


class DriverRemove(_Driver):
    action: ClassVar[str] = "driver.remove"
    install: ClassVar[bool] = False


def _root_path_exists(host: Host, path: str) -> bool:
    return host.path(path).exists()


class CommandRun(_Base):
    """A catalog command (idempotent by contract): always re-run, its effect cannot be read back."""

    action: ClassVar[str] = "command.run"
    verify: ClassVar[bool] = False

    def check(self, host: Host, ctx: StepContext) -> bool:
        return False

    def apply(self, host: Host, ctx: StepContext) -> None:
        ctx.remember(ran=True)
        driverops.run_command(host, _argv(ctx, "argv"))

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        if record.get("ran") and ctx.params.get("undo_argv"):
            driverops.run_command(host, _argv(ctx, "undo_argv"))


class FileWrite(_Base):
    """A whole configuration file, delivered by the agent for a platform the server drives (nova-compute's
    drop-in): the server cannot write a remote host's files, the agent can. Undo puts back what was there."""

    action: ClassVar[str] = "file.write"

    def _target(self, host: Host, ctx: StepContext) -> Path:
        raw = ctx.param("path")
        if not isinstance(raw, str) or not raw.strip("/"):
            raise StepError(f"file.write {ctx.step.target}: parameter 'path' is not a path: {raw!r}")
        target = host.path(raw)
        # the root is the whole world of a step: a path that climbs out of it is refused, not followed
        if ".." in Path(raw).parts or not target.resolve().is_relative_to(host.root.resolve()):
            raise StepError(f"file.write {ctx.step.target}: {raw!r} is outside the host root")
        return target

    def _mode(self, ctx: StepContext) -> int:
        raw = ctx.params.get("mode", "0644")
        try:
            mode = int(str(raw), 8)
        except ValueError:
            raise StepError(
                f'file.write {ctx.step.target}: mode {raw!r} is not octal (e.g. "0644")'
            ) from None
        if not 0 <= mode <= 0o7777:
            raise StepError(f"file.write {ctx.step.target}: mode {raw!r} is out of range")
        return mode

    def check(self, host: Host, ctx: StepContext) -> bool:
        target = self._target(host, ctx)
        content = ctx.param("content")
        try:
            return target.is_file() and target.read_text() == content
        except (OSError, UnicodeDecodeError):
            return False

    def apply(self, host: Host, ctx: StepContext) -> None:
        target = self._target(host, ctx)
        content = ctx.param("content")
        if not isinstance(content, str):
            raise StepError(f"file.write {ctx.step.target}: parameter 'content' is not text")
        mode = self._mode(ctx)
        if target.is_file():
            ctx.remember(previous=target.read_text(), previous_mode=f"{target.stat().st_mode & 0o7777:04o}")
        else:
            ctx.remember(previous=None, previous_mode=None)
        _replace_file(target, content, mode)

    def undo(self, host: Host, ctx: StepContext, record: dict[str, Any]) -> None:
        if "previous" not in record:
            return  # apply never got as far as remembering: it changed nothing
        target = self._target(host, ctx)
        previous = record["previous"]
        if previous is None:
            target.unlink(missing_ok=True)
        else:
            _replace_file(target, str(previous), int(str(record.get("previous_mode") or "0644"), 8))


def _replace_file(path: Path, text: str, mode: int) -> None:
    """Write aside, then rename: a reader (nova-compute starting) sees the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.gpumode-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, mode)  # the umask narrowed the mode os.open was given
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


_IMPLS: tuple[StepImpl, ...] = (
    VmShutdown(),
    VmStart(),
    VmDetachDevice(),
    VgpuRemove(),
    VgpuResolve(),
    VgpuCreate(),
    SriovEnable(),
    SriovDisable(),
    GpuRelease(),
    BindVfio(),
    BindHost(),
    ServiceStart(),
    ServiceStop(),
    ModuleLoad(),
    ModuleUnload(),
    DriverInstall(),
    DriverRemove(),
    CommandRun(),
    FileWrite(),
)


def default_registry() -> StepRegistry:
    """Every host action of ``docs/plan-steps.md``. Cloud actions are not here: the runner skips them."""
    return StepRegistry({impl.action: impl for impl in _IMPLS})
