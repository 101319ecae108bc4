"""From a switch request to a plan: options to the engine's request, the stored whitelist in the engine's
terms, and planning on a node as it last reported itself, with the cloud platform's host steps."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpumode.cloud.base import CloudError, CloudHostSteps, CloudPlatform, SwitchHooks
from gpumode.domain import HostSnapshot, Mode, Plan, SwitchRequest, Vm, VmDevice
from gpumode.modes import policy
from gpumode.modes.catalog import Catalog, load_catalog
from gpumode.modes.plan import plan_switch
from gpumode.server.models import HostGroup, Node
from gpumode.server.schemas import SwitchIn, Whitelist
from gpumode.server.switch.errors import JobError, NotFound


def to_request(options: SwitchIn, platform: CloudPlatform) -> SwitchRequest:
    """The engine's :class:`SwitchRequest`; a profile becomes its vGPU type and count, an alias must exist."""
    vgpu_type, vgpu_count = options.vgpu_type, options.vgpu_count
    if options.profile is not None:
        if options.mode is not Mode.VGPU:
            raise JobError("invalid_option", f"profile only applies to mode vgpu, not {options.mode.value}")
        if vgpu_type is not None or vgpu_count is not None:
            raise JobError("invalid_option", "give either a profile or vgpu_type/vgpu_count, not both")
        profiles = {p.name: p for p in platform.list_profiles()}
        found = profiles.get(options.profile)
        if found is None:
            raise JobError("unknown_profile", f"no vGPU profile named {options.profile!r}", sorted(profiles))
        vgpu_type, vgpu_count = found.vgpu_type, found.count_per_gpu
    if options.passthrough_alias is not None:
        aliases = sorted(a.name for a in platform.list_aliases())
        if options.passthrough_alias not in aliases:
            raise JobError(
                "unknown_alias", f"no passthrough alias named {options.passthrough_alias!r}", aliases
            )
    return SwitchRequest(
        mode=options.mode,
        gpus=list(options.gpus),
        vgpu_type=vgpu_type,
        vgpu_count=vgpu_count,
        passthrough_alias=options.passthrough_alias,
        vm_policy=options.vm_policy,
        allow_boot_vga=options.allow_boot_vga,
    )


def policy_whitelist(stored: Whitelist) -> policy.Whitelist:
    """The stored whitelist in the engine's terms. Groups match by name only (the server knows members)."""
    models: dict[int, frozenset[Mode]] = {}
    for key, modes in stored.models.items():
        vendor, device = key.split(":")
        if vendor == "10de":  # the planner only switches NVIDIA GPUs; other vendors' rules cannot apply
            models[int(device, 16)] = frozenset(modes)
    return policy.Whitelist(
        source="the server's whitelist (GET /api/v1/modes)",
        platform=frozenset(stored.platform),
        groups=tuple(policy.HostGroup(name, (), frozenset(m)) for name, m in stored.groups.items()),
        models=models,
    )


def stored_vms(node: Node) -> list[Vm]:
    return [
        Vm(v["name"], v["uuid"], v["running"], [VmDevice(d["kind"], d["id"]) for d in v.get("devices", [])])
        for v in node.vms or []
    ]


def catalog() -> Catalog:
    """The built-in catalog (GPU models, vGPU types, driver flavours); ``load_catalog`` caches its parse."""
    return load_catalog(None)


def plan_for_node(
    session: Session,
    node: Node,
    request: SwitchRequest,
    whitelist: Whitelist,
    platform: CloudPlatform,
) -> Plan:
    """Plan ``request`` on the node as it last reported itself; :class:`JobError` when it may not run.

    The platform is required, not optional: the host steps it asks for (:meth:`SwitchHooks.host_steps`,
    e.g. delivering nova-compute's configuration) are part of the plan, so a dry run shows exactly what a
    job runs, and no caller (a rollout, say) can plan a job that lacks them.
    """
    group = session.scalar(select(HostGroup.name).where(HostGroup.id == node.group_id))
    snapshot = HostSnapshot.from_dict(node.snapshot)
    rules = policy_whitelist(whitelist)
    try:
        plan = plan_switch(
            snapshot,
            stored_vms(node),
            request,
            catalog=catalog(),
            whitelist=rules,
            host_group=group if group in whitelist.groups else None,
        )
    except policy.RequestError as exc:
        raise JobError(exc.code, exc.message, exc.choices) from exc
    hooks = switch_hooks(platform)
    if hooks is None:
        return plan
    try:
        extra = hooks.host_steps(plan, snapshot)
    except CloudError as exc:
        raise JobError("cloud_refused", str(exc)) from exc
    return with_host_steps(plan, extra)


def switch_hooks(platform: CloudPlatform | None) -> SwitchHooks | None:
    """The platform's switch hooks, when it has them."""
    return platform if isinstance(platform, SwitchHooks) else None


def with_host_steps(plan: Plan, extra: CloudHostSteps) -> Plan:
    """``plan`` with a platform's host steps: ``first`` before every host step, ``last`` after them and
    before the cloud steps; ids renumbered (``NN-action-target``) so they stay unique and ordered."""
    if not extra.first and not extra.last:
        return plan
    host = [s for s in plan.steps if s.where == "host"]
    cloud = [s for s in plan.steps if s.where != "host"]
    ordered = [*extra.first, *host, *extra.last, *cloud]
    steps = [replace(s, id=f"{i:02d}-{s.action}-{s.target}") for i, s in enumerate(ordered, start=1)]
    impact = replace(plan.impact, estimated_seconds=round(sum(s.estimate_s for s in steps), 3))
    return replace(plan, steps=steps, impact=impact)


def find_node(session: Session, name: str) -> Node:
    node = session.scalars(select(Node).where(Node.name == name)).first()
    if node is None:
        raise NotFound(f"no node named {name!r}")
    return node
