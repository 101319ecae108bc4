"""The planner: host snapshot + VMs + switch request → an ordered, idempotent list of steps and their impact.

Pure: it reads only its arguments (the snapshot discovery made, the hypervisor's VM list, the catalog and
the whitelist), so the plan shown by ``--dry-run``, stored with a job and executed is one and the same. Each
step's ``action``/``target``/``params`` follow ``docs/plan-steps.md``, the contract with the step executor.

The shape follows the method's steps 4–7 (docs/architecture.md explains the numbering): when the host's driver
flavour is already right only card and environment steps are emitted; otherwise the old flavour is torn down
(its vGPUs reclaimed from VMs first) and the new one installed. Passthrough never changes the host driver: a
GPU is released from it and moved, with its whole IOMMU group, to vfio-pci. Only GPUs the request names are
moved; the others keep their mode, and the driver under them is left alone unless the request covers them
(``policy.check_compatible`` refuses the rest).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumode.domain import (
    Flavour,
    Gpu,
    HostSnapshot,
    Impact,
    Mode,
    Plan,
    SriovLayoutError,
    Step,
    SwitchRequest,
    Vm,
    VmDevice,
    VmPolicy,
)
from gpumode.modes.catalog import Catalog, FlavourSpec
from gpumode.modes.policy import (
    RequestError,
    Resolved,
    VgpuChoice,
    Whitelist,
    boot_display,
    model_of,
    resolve_request,
)

VFIO_DRIVER = "vfio-pci"
VFIO_MODULE = "vfio_pci"
_BRIDGE_CLASSES = frozenset({0x0600, 0x0604, 0x0609})  # host/PCI/PCI-PCI bridges: never bound to vfio-pci
# fixed, so the mdev UUIDs a plan names are the same every time it is made
_MDEV_NAMESPACE = uuid.UUID("5f0b8e5c-6a53-4d4b-9d3e-6770756d6f64")


def plan_switch(
    snapshot: HostSnapshot,
    vms: Sequence[Vm],
    request: SwitchRequest,
    *,
    catalog: Catalog,
    whitelist: Whitelist,
    host_group: str | None = None,
) -> Plan:
    """Plan ``request`` on the host ``snapshot`` describes; :class:`RequestError` when it may not run."""
    resolved = resolve_request(snapshot, request, catalog, whitelist, host_group=host_group)
    return _Planner(snapshot, list(vms), resolved, catalog).plan()


def host_steps(plan: Plan) -> list[Step]:
    """The steps the agent / local engine runs (cloud steps are the server's)."""
    return [s for s in plan.steps if s.where == "host"]


@dataclass(slots=True)
class _Draft:
    """A step before it gets its position-based id."""

    action: str
    target: str
    params: dict[str, Any]
    description: str
    where: str = "host"


@dataclass(slots=True)
class _GpuWork:
    """What happens to one requested GPU."""

    gpu: Gpu
    target: Mode
    remove_vgpus: bool = False
    disable_vfs: bool = False
    to_vfio: bool = False
    to_host: bool = False
    create_vgpus: VgpuChoice | None = None
    touched: bool = False  # VMs holding its devices are affected
    detach: set[tuple[str, str]] = field(default_factory=set)  # (kind, id) leaving VM definitions


class _Planner:
    def __init__(self, snapshot: HostSnapshot, vms: list[Vm], resolved: Resolved, catalog: Catalog) -> None:
        self.snap = snapshot
        self.vms = sorted(vms, key=lambda v: v.name)
        self.res = resolved
        self.catalog = catalog
        self.nvswitch = bool(snapshot.nvswitches)
        self.loaded = {m.name for m in snapshot.modules}
        self.services = {_unit(k): v for k, v in snapshot.nvidia.services.items()}
        self.installed = {p.name for p in snapshot.nvidia.packages}
        self.impact = Impact()

    # --- the whole plan -------------------------------------------------------------------------------------

    def plan(self) -> Plan:
        installed = self._installed_flavours()
        target = self._target_flavour()
        teardown = sorted(installed - {target}) if target is not None else []
        install = target is not None and target not in installed
        reloads = bool(teardown)
        work = [self._gpu_work(g, reloads) for g in self.res.gpus]

        # GPU clients (persistenced, vgpu-mgr) keep every GPU open; releasing one or changing its VFs needs
        # them stopped, as NVIDIA's own units order sriov-manage before nvidia-vgpu-mgr
        needs_free = any(
            w.disable_vfs or (w.to_vfio and w.gpu.driver == "nvidia") or self._needs_vfs(w) for w in work
        )
        vgpu_down = self._vgpu_remove(work)
        quiesce, stopped = self._quiesce(installed, teardown, needs_free)
        sriov_down = self._sriov_disable(work)
        vfio_in = self._passthrough_in(work)
        driver_down, unloaded = self._driver_teardown(teardown)
        driver_up = self._driver_install(target, install, unloaded) if target is not None else []
        cards = self._cards_to_host(work, reloads or "nvidia" in unloaded)
        sriov_up = self._sriov_enable(work)
        services = self._services_up(target, install or bool(unloaded), stopped, teardown)
        post = self._post_install(target) if install and target is not None else []
        vgpu_up = self._vgpu_create(work)
        host = [
            *vgpu_down, *quiesce, *sriov_down, *vfio_in, *driver_down, *driver_up, *cards, *sriov_up,
            *services, *post, *vgpu_up,
        ]  # fmt: skip
        vm_steps = self._vm_steps(work, any_host_step=bool(host))
        drafts = [*vm_steps, *host, *self._vm_restarts(vm_steps), *self._cloud_steps()]

        steps = [self._step(i, d) for i, d in enumerate(drafts, start=1)]
        for w in work:
            if w.to_vfio and boot_display(self.snap, w.gpu):
                self.impact.notes.append(
                    f"GPU {w.gpu.address} is the boot display (boot_vga = 1): the host console goes dark "
                    "when it moves to vfio-pci"
                )
        self.impact.gpus = {w.gpu.address: (w.gpu.mode, w.target) for w in work}
        self.impact.driver_change = bool(teardown) or install
        self.impact.estimated_seconds = round(sum(s.estimate_s for s in steps), 3)
        return Plan(self.snap.hostname, self.res.request, steps, self.impact, self.snap.fingerprint)

    def _step(self, index: int, d: _Draft) -> Step:
        return Step(
            id=f"{index:02d}-{d.action}-{d.target}",
            action=d.action,
            target=d.target,
            params=d.params,
            description=d.description,
            where=d.where,
            estimate_s=self.catalog.estimate(d.action),
        )

    # --- driver flavours ------------------------------------------------------------------------------------

    def _installed_flavours(self) -> set[Flavour]:
        """Flavours on the host: by their catalog packages (apt), or as discovery detected the module."""
        out: set[Flavour] = set()
        for flavour, spec in self.catalog.flavours.items():
            driver_packages = [p.name for p in spec.installer.packages if not p.keep_on_remove]
            if spec.installer.kind == "apt" and self.installed.intersection(driver_packages):
                out.add(flavour)
        if self.snap.nvidia.flavour is not None:
            out.add(self.snap.nvidia.flavour)
        return out

    def _target_flavour(self) -> Flavour | None:
        """The flavour the host needs afterwards; None when no GPU uses the host driver (keep what is)."""
        modes = set(self.res.after.values())
        if Mode.ACCEL in modes:
            return Flavour.DATACENTER
        if Mode.VGPU in modes:
            return Flavour.VGPU
        return None

    # --- per GPU --------------------------------------------------------------------------------------------

    def _gpu_work(self, gpu: Gpu, reloads: bool) -> _GpuWork:
        target = self.res.request.mode
        w = _GpuWork(gpu, target)
        pf = self.snap.function(gpu.address)
        vgpus = self._vgpus(gpu)
        choice = self.res.vgpu.get(gpu.address)
        same_layout = (
            choice is not None
            and len(vgpus) == choice.count
            and all(type_id == choice.type.id for _, _, type_id in vgpus)
        )
        w.remove_vgpus = bool(vgpus) and not (target is Mode.VGPU and same_layout)
        num_vfs = pf.sriov.num_vfs if pf is not None and pf.sriov is not None else 0
        w.disable_vfs = num_vfs > 0 and target is not Mode.VGPU
        if target is Mode.PASSTHROUGH:
            w.to_vfio = not self._on_vfio(gpu)
        elif gpu.mode is Mode.PASSTHROUGH or gpu.driver == VFIO_DRIVER:
            w.to_host = True
        if target is Mode.VGPU and not same_layout:
            w.create_vgpus = choice
        w.touched = (
            w.remove_vgpus or w.disable_vfs or w.to_host or (w.to_vfio and gpu.mode is not Mode.PASSTHROUGH)
        ) or (reloads and gpu.driver == "nvidia")
        if w.remove_vgpus or w.disable_vfs:
            w.detach |= {("mdev", u) for u in gpu.mdevs} | {("pci", a) for a in gpu.vfs}
        if w.to_host:
            w.detach |= {("pci", a) for a in [gpu.address, *gpu.companions]}
        return w

    def _vgpus(self, gpu: Gpu) -> list[tuple[str, str, int]]:
        """The GPU's vGPUs now: (parent address, mdev uuid or "", type id), mdevs and vendor VFs alike."""
        out: list[tuple[str, str, int]] = []
        for address in [gpu.address, *gpu.vfs]:
            fn = self.snap.function(address)
            if fn is None:
                continue
            for m in fn.mdevs:
                tail = m.type_id.rsplit("-", 1)[-1]
                out.append((address, m.uuid, int(tail) if tail.isdigit() else -1))
            if fn.vendor_vgpu is not None and fn.vendor_vgpu.current:
                out.append((address, "", fn.vendor_vgpu.current))
        return sorted(out)

    def _group(self, gpu: Gpu) -> list[str]:
        """The GPU and the functions that move with it (its IOMMU group and consumers), bridges excluded."""
        out = [gpu.address]
        for address in sorted(set(gpu.companions)):
            fn = self.snap.function(address)
            if fn is not None and fn.class_code >> 8 in _BRIDGE_CLASSES:
                continue
            if address not in out:
                out.append(address)
        return out

    def _on_vfio(self, gpu: Gpu) -> bool:
        for address in self._group(gpu):
            fn = self.snap.function(address)
            if fn is None or fn.driver != VFIO_DRIVER or fn.driver_override != VFIO_DRIVER:
                return False
        return True

    # --- phase 1: VMs ---------------------------------------------------------------------------------------

    def _vm_steps(self, work: list[_GpuWork], *, any_host_step: bool) -> list[_Draft]:
        held: set[tuple[str, str]] = set()
        detach: set[tuple[str, str]] = set()
        for w in work:
            if w.touched:
                g = w.gpu
                held |= {("pci", a) for a in [g.address, *g.companions, *g.vfs]} | {
                    ("mdev", u) for u in g.mdevs
                }
                detach |= w.detach
        holders = [vm for vm in self.vms if any((d.kind, d.id) in held for d in vm.devices)]
        detaching = [(vm, d) for vm in self.vms for d in vm.devices if (d.kind, d.id) in detach]
        policy = self.res.request.vm_policy
        if policy is VmPolicy.REFUSE:
            touched = sorted({vm.name for vm in holders if vm.running} | {vm.name for vm, _ in detaching})
            if touched:
                raise RequestError(
                    "vm_policy_refused",
                    f"VM policy 'refuse': the switch would touch VM(s) {', '.join(touched)} "
                    "(they hold devices of the GPUs being switched); stop or move them, or use policy "
                    "gpu or all",
                    [p.value for p in VmPolicy if p is not VmPolicy.REFUSE],
                )
        if policy is VmPolicy.ALL:
            stop = [vm for vm in self.vms if vm.running] if any_host_step or detaching else []
        else:
            stop = [vm for vm in holders if vm.running]
        timeout = self.catalog.vm_shutdown_timeout_s
        drafts = [
            _Draft("vm.shutdown", vm.name, {"timeout_s": timeout}, f"shut down VM {vm.name}") for vm in stop
        ]
        for vm, dev in sorted(detaching, key=lambda p: (p[0].name, p[1].kind, p[1].id)):
            drafts.append(
                _Draft(
                    "vm.detach_device",
                    vm.name,
                    {"kind": dev.kind, "id": dev.id},
                    f"remove {dev} from the definition of VM {vm.name}",
                )
            )
            self.impact.devices_detached.append(f"{vm.name}: {VmDevice(dev.kind, dev.id)}")
        self.impact.vms_stopped = [vm.name for vm in stop]
        return drafts

    def _vm_restarts(self, vm_steps: list[_Draft]) -> list[_Draft]:
        """Phase 12b: the VMs the plan shuts down that keep every device are started again (request option
        ``restart_vms``, on by default); those that lose a device stay stopped for the cloud to move."""
        stopped = [d.target for d in vm_steps if d.action == "vm.shutdown"]
        losing = {d.target for d in vm_steps if d.action == "vm.detach_device"}
        keep = [name for name in stopped if name not in losing] if self.res.request.restart_vms else []
        self.impact.vms_restarted = keep
        self.impact.vms_left_stopped = [name for name in stopped if name in losing]
        return [_Draft("vm.start", name, {}, f"start VM {name} again") for name in keep]

    # --- phases 2-4: vGPUs out, GPU clients stopped, VFs off ------------------------------------------------

    def _vgpu_remove(self, work: list[_GpuWork]) -> list[_Draft]:
        drafts: list[_Draft] = []
        for w in work:
            if not w.remove_vgpus:
                continue
            for parent, mdev_uuid, type_id in self._vgpus(w.gpu):
                if mdev_uuid:
                    params: dict[str, Any] = {
                        "interface": "mdev",
                        "uuid": mdev_uuid,
                        "type_id": f"nvidia-{type_id}",
                    }
                    what = f"mdev {mdev_uuid}"
                    self.impact.vgpus_reclaimed.append(mdev_uuid)
                else:
                    params = {"interface": "vendor", "type": type_id}
                    what = f"vGPU type {type_id} of VF {parent}"
                    self.impact.vgpus_reclaimed.append(parent)
                drafts.append(_Draft("vgpu.remove", parent, params, f"remove {what}"))
        return drafts

    def _quiesce(
        self, installed: set[Flavour], teardown: list[Flavour], needs_free: bool
    ) -> tuple[list[_Draft], list[str]]:
        """Stop the units of a flavour being removed, and the GPU-holding ones when a GPU must be free."""
        drafts: list[_Draft] = []
        stopped: list[str] = []
        for flavour in sorted(installed):
            spec = self.catalog.flavour(flavour)
            ours = spec.units(nvswitch=self.nvswitch)
            for svc in reversed(spec.services):
                unit = svc.unit
                # running, or not reported: a unit discovery could not read may be running
                running = self.services.get(unit) or (unit in ours and self.services.get(unit) is None)
                if running and (flavour in teardown or (needs_free and svc.holds_gpus)):
                    drafts.append(_Draft("service.stop", unit, {}, f"stop {unit}"))
                    stopped.append(unit)
        return drafts, stopped

    def _sriov_disable(self, work: list[_GpuWork]) -> list[_Draft]:
        drafts: list[_Draft] = []
        tool = self._sriov_tool()
        for w in work:
            pf = self.snap.function(w.gpu.address)
            if w.disable_vfs and pf is not None and pf.sriov is not None:
                a = w.gpu.address
                drafts.append(
                    _Draft(
                        "sriov.disable",
                        a,
                        {"num_vfs": pf.sriov.num_vfs, "argv": [tool, "-d", a], "undo_argv": [tool, "-e", a]},
                        f"disable the {pf.sriov.num_vfs} SR-IOV VFs of {a}",
                    )
                )
        return drafts

    def _sriov_tool(self) -> str:
        return self.catalog.flavour(Flavour.VGPU).sriov_manage or "sriov-manage"

    # --- phase 5: GPUs into passthrough ---------------------------------------------------------------------

    def _passthrough_in(self, work: list[_GpuWork]) -> list[_Draft]:
        moving = [w for w in work if w.to_vfio]
        drafts: list[_Draft] = []
        if moving and VFIO_MODULE not in self.loaded:
            drafts.append(_Draft("module.load", VFIO_MODULE, {}, "load vfio-pci"))
            self.impact.modules_loaded.append(VFIO_MODULE)
        for w in moving:
            g = w.gpu
            if g.driver is not None and g.driver != VFIO_DRIVER:
                drafts.append(
                    _Draft(
                        "gpu.release", g.address, {"driver": g.driver}, f"release {g.address} from {g.driver}"
                    )
                )
            group = self._group(g)
            drafts.append(
                _Draft(
                    "bind.vfio",
                    g.address,
                    {"functions": group, "persist": True},
                    f"bind {', '.join(group)} to vfio-pci (persistent)",
                )
            )
        return drafts

    # --- phase 6: old flavour out ---------------------------------------------------------------------------

    def _driver_teardown(self, flavours: Iterable[Flavour]) -> tuple[list[_Draft], set[str]]:
        drafts: list[_Draft] = []
        unloaded: set[str] = set()
        for flavour in flavours:
            spec = self.catalog.flavour(flavour)
            for module in self._unload_order(spec.modules):
                if module in unloaded:
                    continue
                unloaded.add(module)
                drafts.append(_Draft("module.unload", module, {}, f"unload module {module}"))
                self.impact.modules_unloaded.append(module)
                info = next(m for m in self.snap.modules if m.name == module)
                if "[permanent]" in info.users or info.state != "Live":
                    self.impact.reboot_required = True
            remove = self._driver_params(spec, install=False)
            if remove is not None:
                drafts.append(
                    _Draft("driver.remove", flavour.value, remove, f"remove the {flavour.value} driver")
                )
                self.impact.packages_removed.extend(remove["packages"] or [f"{flavour.value} (.run)"])
        return drafts, unloaded

    def _unload_order(self, modules: Sequence[str]) -> list[str]:
        """The flavour's loaded modules and every loaded module using them, users first, deterministic."""
        users = {m.name: [u for u in m.users if u in self.loaded] for m in self.snap.modules}
        wanted = [m for m in modules if m in self.loaded]
        order: list[str] = []

        def visit(name: str, path: tuple[str, ...]) -> None:
            if name in order or name in path:
                return
            for user in sorted(users.get(name, [])):
                visit(user, (*path, name))
            order.append(name)

        for module in reversed(wanted):
            visit(module, ())
        return order

    def _driver_params(self, spec: FlavourSpec, *, install: bool) -> dict[str, Any] | None:
        inst = spec.installer
        base: dict[str, Any] = {
            "flavour": spec.flavour.value,
            "version": spec.version,
            "installer": inst.kind,
        }
        if inst.kind == "run":
            return {
                **base,
                "packages": [],
                "command": list(inst.command),
                "remove_command": list(inst.remove_command),
                "detect_path": inst.detect_path,
            }
        if install:
            names = [p.name for p in spec.packages(nvswitch=self.nvswitch) if p.name not in self.installed]
        else:
            ours = [p.name for p in inst.packages if not p.keep_on_remove]
            applicable = [p.name for p in spec.packages(nvswitch=self.nvswitch) if not p.keep_on_remove]
            # the flavour is on the host (its module is loaded) but none of its packages is known installed:
            # name them all; removing an absent package is a no-op, and the other flavour needs them gone
            names = [n for n in ours if n in self.installed] or applicable
        if not names:
            return None
        return {**base, "packages": names, "command": None, "remove_command": None, "detect_path": None}

    # --- phases 7, 10, 11: new flavour in, services, post-install -------------------------------------------

    def _driver_install(self, flavour: Flavour, install: bool, unloaded: set[str]) -> list[_Draft]:
        spec = self.catalog.flavour(flavour)
        drafts: list[_Draft] = []
        if install:
            params = self._driver_params(spec, install=True)
            if params is not None:
                drafts.append(
                    _Draft("driver.install", flavour.value, params, f"install the {flavour.value} driver")
                )
                self.impact.packages_installed.extend(params["packages"] or [f"{flavour.value} (.run)"])
        loaded = self.loaded - unloaded
        for module in spec.modules:
            if module not in loaded:
                drafts.append(_Draft("module.load", module, {}, f"load module {module}"))
                self.impact.modules_loaded.append(module)
        return drafts

    def _services_up(
        self, flavour: Flavour | None, fresh: bool, stopped: list[str], teardown: list[Flavour]
    ) -> list[_Draft]:
        """Start the target flavour's units (all after a (re)load, else those reported stopped), and restart
        the units :meth:`_quiesce` stopped whose flavour stays."""
        units: list[str] = []
        if flavour is not None:
            for unit in self.catalog.flavour(flavour).units(nvswitch=self.nvswitch):
                if (
                    (fresh and not self.services.get(unit))
                    or self.services.get(unit) is False
                    or unit in stopped
                ):
                    units.append(unit)
        gone = {s.unit for f in teardown for s in self.catalog.flavour(f).services}
        for unit in reversed(stopped):
            if unit not in gone and unit not in units:
                units.append(unit)
        return [_Draft("service.start", unit, {}, f"start {unit}") for unit in units]

    def _post_install(self, flavour: Flavour) -> list[_Draft]:
        drafts: list[_Draft] = []
        for cmd in self.catalog.flavour(flavour).post_install:
            params = {"argv": list(cmd.argv), "undo_argv": list(cmd.undo_argv) if cmd.undo_argv else None}
            drafts.append(_Draft("command.run", cmd.name, params, f"run {' '.join(cmd.argv)}"))
        return drafts

    # --- phase 8: GPUs back to the host driver --------------------------------------------------------------

    def _cards_to_host(self, work: list[_GpuWork], reloaded: bool) -> list[_Draft]:
        drafts: list[_Draft] = []
        for w in work:
            g = w.gpu
            if w.target not in (Mode.ACCEL, Mode.VGPU):
                continue
            if g.driver not in (None, "nvidia", VFIO_DRIVER):
                drafts.append(
                    _Draft(
                        "gpu.release", g.address, {"driver": g.driver}, f"release {g.address} from {g.driver}"
                    )
                )
            if w.to_host or g.driver != "nvidia" or reloaded:
                group = self._group(g)
                drivers: dict[str, str | None] = {a: None for a in group}
                drivers[g.address] = "nvidia"
                drafts.append(
                    _Draft("bind.host", g.address, {"drivers": drivers}, f"bind {g.address} to nvidia")
                )
        return drafts

    # --- phases 9, 12: VFs on, vGPUs ------------------------------------------------------------------------

    def _needs_vfs(self, w: _GpuWork) -> bool:
        """Does the GPU need its SR-IOV VFs enabled before its vGPUs can be created?"""
        choice = w.create_vgpus
        if choice is None or choice.offer.parent != "vf":
            return False
        pf = self.snap.function(w.gpu.address)
        return pf is None or pf.sriov is None or pf.sriov.num_vfs == 0

    def _sriov_enable(self, work: list[_GpuWork]) -> list[_Draft]:
        drafts: list[_Draft] = []
        tool = self._sriov_tool()
        for w in work:
            if not self._needs_vfs(w) or w.create_vgpus is None:
                continue
            a = w.gpu.address
            pf = self.snap.function(a)
            total = (
                pf.sriov.total_vfs
                if pf is not None and pf.sriov is not None
                else w.create_vgpus.offer.num_vfs
            )
            drafts.append(
                _Draft(
                    "sriov.enable",
                    a,
                    {"num_vfs": total, "argv": [tool, "-e", a], "undo_argv": [tool, "-d", a]},
                    f"enable the SR-IOV VFs of {a}",
                )
            )
        return drafts

    def _vgpu_create(self, work: list[_GpuWork]) -> list[_Draft]:
        drafts: list[_Draft] = []
        for w in work:
            choice = w.create_vgpus
            if choice is None:
                continue
            a = w.gpu.address
            t = choice.type
            if choice.offer.source == "catalog":
                # the host could not show its types when this was planned: check them before creating any
                resolve = {"name": t.name, "type": t.id, "interface": choice.offer.interface}
                what = f"check that {a} offers {t.name} as type {t.id} ({choice.offer.interface})"
                drafts.append(_Draft("vgpu.resolve", a, resolve, what))
            vfs = self._vf_addresses(a, choice.count) if choice.offer.parent == "vf" else []
            for index in range(choice.count):
                vf_index = index if choice.offer.parent == "vf" else None
                if choice.offer.interface == "mdev":
                    mdev_uuid = str(uuid.uuid5(_MDEV_NAMESPACE, f"{self.snap.hostname}/{a}/{index}/{t.id}"))
                    params: dict[str, Any] = {
                        "interface": "mdev",
                        "vf_index": vf_index,
                        "type_id": t.mdev_type,
                        "name": t.name,
                        "uuid": mdev_uuid,
                    }
                else:
                    params = {"interface": "vendor", "vf_index": vf_index, "type": t.id, "name": t.name}
                where = a
                if vf_index is not None:
                    known = f" ({vfs[vf_index]})" if vf_index < len(vfs) else ""
                    where = f"VF {vf_index}{known} of {a}"
                drafts.append(_Draft("vgpu.create", a, params, f"create a {t.name} vGPU on {where}"))
        return drafts

    def _vf_addresses(self, pf_address: str, count: int) -> list[str]:
        """The GPU's first ``count`` VFs for the descriptions: those that exist, else where offset and stride
        put them; ``[]`` when the snapshot cannot tell (the step finds ``virtfn<vf_index>`` when it runs)."""
        pf = self.snap.function(pf_address)
        if pf is None or pf.sriov is None:
            return []
        if len(pf.sriov.vfs) >= count:
            return pf.sriov.vfs[:count]
        try:
            return pf.vf_addresses(count)
        except SriovLayoutError:
            return []

    # --- phase 13: cloud ------------------------------------------------------------------------------------

    def _cloud_steps(self) -> list[_Draft]:
        req = self.res.request
        cards: list[dict[str, Any]] = []
        for g in self.res.gpus:
            choice = self.res.vgpu.get(g.address)
            cards.append(
                {
                    "gpu": g.address,
                    "mode": req.mode.value,
                    "model": f"10de:{g.device:04x}",
                    "vgpu_type": choice.type.name if choice else None,
                    "vgpu_count": choice.count if choice else None,
                    "alias": self._alias(g) if req.mode is Mode.PASSTHROUGH else None,
                }
            )
        host = self.snap.hostname
        aliases = sorted({c["alias"] for c in cards if c["alias"]})
        types = sorted({c["vgpu_type"] for c in cards if c["vgpu_type"]})
        env = {
            "modes": [req.mode.value],
            "gpus": [g.address for g in self.res.gpus],
            "alias": aliases[0] if len(aliases) == 1 else (", ".join(aliases) or None),
            "vgpu_type": types[0] if len(types) == 1 else (", ".join(types) or None),
        }
        # one card per vGPU the host creates (per GPU: its count), one per GPU otherwise
        total = sum(c["vgpu_count"] or 1 for c in cards) if req.mode is Mode.VGPU else len(cards)
        on = f" on {len(cards)} GPU(s)" if total != len(cards) else ""
        return [
            _Draft(
                "cloud.register_cards",
                host,
                {"cards": cards},
                f"register {total} {req.mode.value} card(s){on}",
                where="cloud",
            ),
            _Draft("cloud.deploy_env", host, env, f"deploy the {req.mode.value} environment", where="cloud"),
        ]

    def _alias(self, gpu: Gpu) -> str:
        if self.res.request.passthrough_alias:
            return self.res.request.passthrough_alias.strip()
        model = model_of(self.snap, gpu, self.catalog)
        return model.alias if model is not None else f"10de-{gpu.device:04x}"


def _unit(name: str) -> str:
    return name if "." in name else f"{name}.service"
