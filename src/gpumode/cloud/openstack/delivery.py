"""The host steps that deliver nova-compute's configuration with a switch: the server plans them, the agent
runs them (the server cannot write a remote host's files).

The drop-in must describe the host *after* the switch, but the plan is made before it: :func:`predict` applies
the plan's effect to the snapshot (each GPU's new mode, the VFs its ``sriov.enable`` steps make, the mdevs its
``vgpu.create`` steps make) and :func:`~gpumode.cloud.openstack.novaconf.render_dropin` renders that.
nova-compute reads the file only when it starts, so a restart follows; the restart is a ``checkpoint``: when
the agent reports it done, the server checks that Placement is there before the switch goes on
(:mod:`gpumode.server.switch`).

Three steps, so that a rollback leaves nova-compute running the old configuration on the old host:

1. ``command.run nova-compute-rollback`` first: nothing forward (``true``); its undo — the last undo of a
   rollback, when every device and the old drop-in are back — restarts nova-compute.
2. ``file.write`` the drop-in (undo: the previous file, or none).
3. ``command.run nova-compute`` restarts nova-compute with the new file.
"""

from __future__ import annotations

from gpumode.cloud.base import CloudHostSteps
from gpumode.cloud.openstack.http import OpenStackError
from gpumode.domain import HostSnapshot, Mdev, PciAddress, PciFunction, Plan, SriovLayoutError, Step

RESTART_TARGET = "nova-compute"
ROLLBACK_TARGET = "nova-compute-rollback"
NOTHING = ["true"]  # the forward half of a step that exists for its undo only


def predict(plan: Plan, snapshot: HostSnapshot) -> HostSnapshot:
    """The host as the plan leaves it, as far as nova's configuration needs: GPU modes, VFs and mdevs.

    VFs that ``sriov.enable`` makes are placed where the kernel will put them (from the PF's ``sriov_offset``
    and ``sriov_stride``), since nova's ``device_addresses`` must name them. Raises :class:`OpenStackError`
    for a vGPU on a VF whose address cannot be known (a snapshot without offset and stride, from an older
    agent).
    """
    after = HostSnapshot.from_dict(snapshot.to_dict())
    touched = {a: new for a, (_, new) in plan.impact.gpus.items()}
    for gpu in after.gpus:
        if gpu.address not in touched:
            continue
        gone = set(gpu.mdevs)
        for fn in after.functions:
            fn.mdevs = [m for m in fn.mdevs if m.uuid not in gone]
        gpu.mode, gpu.mdevs, gpu.vgpus = touched[gpu.address], [], []
    unknown: dict[str, str] = {}  # PF -> why its VFs' addresses cannot be known
    for step in plan.steps:
        if step.action == "sriov.enable":
            try:
                _enable_vfs(after, step)
            except SriovLayoutError as exc:
                unknown[step.target] = exc.reason
        elif step.action == "vgpu.create":
            _add_vgpu(after, step, unknown)
    return after


def _enable_vfs(after: HostSnapshot, step: Step) -> None:
    """Add the VFs ``sriov.enable`` makes, at the addresses the kernel will give them."""
    pf = after.function(step.target)
    if pf is None or pf.sriov is None:
        raise SriovLayoutError(step.target, "the snapshot does not list it as an SR-IOV PF")
    addresses = pf.vf_addresses(int(step.params["num_vfs"]))
    existing = {fn.address for fn in after.functions}
    for address in addresses:
        if address not in existing:
            after.functions.append(
                PciFunction(
                    address, pf.vendor, pf.device, pf.subsystem_vendor, pf.subsystem_device, pf.class_code,
                    pf.revision, numa_node=pf.numa_node, driver=pf.driver, physfn=pf.address,
                )
            )  # fmt: skip
    after.functions.sort(key=lambda fn: PciAddress.parse(fn.address))
    pf.sriov.num_vfs, pf.sriov.vfs = len(addresses), list(addresses)
    gpu = after.gpu(pf.address)
    if gpu is not None:
        gpu.vfs = list(addresses)


def _add_vgpu(after: HostSnapshot, step: Step, unknown: dict[str, str]) -> None:
    gpu = after.gpu(step.target)
    if gpu is None:
        raise OpenStackError(f"the plan creates a vGPU on {step.target}, which the host does not list")
    index = step.params.get("vf_index")
    parent = step.target
    if index is not None:
        pf = after.function(step.target)
        vfs = pf.sriov.vfs if pf is not None and pf.sriov is not None else []
        if int(index) >= len(vfs):
            why = unknown.get(step.target, "the plan does not enable them")
            raise OpenStackError(
                f"GPU {step.target}: its vGPUs go on SR-IOV VFs that do not exist yet, and the nova-compute "
                f"drop-in must name them: {why}"
            )
        parent = vfs[int(index)]
    if step.params.get("interface") == "vendor":
        gpu.vgpus.append(parent)
        return
    mdev = Mdev(uuid=str(step.params["uuid"]), type_id=str(step.params["type_id"]), parent=parent)
    fn = after.function(parent)
    if fn is None:
        raise OpenStackError(f"the plan creates a vGPU on {parent}, which the host does not list")
    fn.mdevs.append(mdev)
    gpu.mdevs.append(mdev.uuid)


def delivery_steps(
    *, dropin_path: str, dropin: str, restart: list[str], estimate_s: float = 5.0
) -> CloudHostSteps:
    """The three steps of the module doc (ids are given when they are placed in the plan)."""
    first = Step(
        id="",
        action="command.run",
        target=ROLLBACK_TARGET,
        params={"argv": list(NOTHING), "undo_argv": list(restart)},
        description="nothing now; if the switch is rolled back, restart nova-compute on the restored host",
        estimate_s=0.0,
    )
    write = Step(
        id="",
        action="file.write",
        target=dropin_path,
        params={"path": dropin_path, "content": dropin, "mode": "0644"},
        description=f"write nova-compute's drop-in {dropin_path} for the GPUs' new modes",
        estimate_s=0.1,
    )
    restart_step = Step(
        id="",
        action="command.run",
        target=RESTART_TARGET,
        params={"argv": list(restart), "undo_argv": None, "checkpoint": True},
        description="restart nova-compute so it reports the new GPU inventory to Placement",
        estimate_s=estimate_s,
    )
    return CloudHostSteps(first=(first,), last=(write, restart_step))


def is_delivery(step: Step | dict[str, object], dropin_path: str) -> bool:
    """Is this the step that writes the drop-in at ``dropin_path``?"""
    action = step.action if isinstance(step, Step) else step.get("action")
    target = step.target if isinstance(step, Step) else step.get("target")
    return action == "file.write" and target == dropin_path
