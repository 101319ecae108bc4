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
from gpumode.server.schemas import SwitchIn
from gpumode.server.switch.errors import JobError, NotFound


def to_request(body: SwitchIn, platform: CloudPlatform) -> SwitchRequest:
    """The engine's :class:`SwitchRequest`, checked by the one request check
    (:func:`~gpumode.modes.policy.parse_request`); a profile becomes its vGPU type and count, an alias must
    exist on the platform."""
    vgpu_type, vgpu_count = body.vgpu_type, body.vgpu_count
    if body.profile is not None:
        mode = policy.parse_mode(body.mode)
        if mode is not Mode.VGPU:
            raise JobError("invalid_option", f"profile only applies to mode vgpu, not {mode.value}")
        if vgpu_type is not None or vgpu_count is not None:
            raise JobError("invalid_option", "give either a profile or vgpu_type/vgpu_count, not both")
        profiles = {p.name: p for p in platform.list_profiles()}
        found = profiles.get(body.profile)
        if found is None:
            raise JobError("unknown_profile", f"no vGPU profile named {body.profile!r}", sorted(profiles))
        vgpu_type, vgpu_count = found.vgpu_type, found.count_per_gpu
    request = policy.parse_request(
        mode=body.mode,
        gpus=body.gpus,
        vgpu_type=vgpu_type,
        vgpu_count=vgpu_count,
        passthrough_alias=body.passthrough_alias,
        vm_policy=body.vm_policy,
        allow_boot_vga=body.allow_boot_vga,
    )
    if body.passthrough_alias is not None:
        aliases = sorted(a.name for a in platform.list_aliases())
        if body.passthrough_alias not in aliases:
            raise JobError("unknown_alias", f"no passthrough alias named {body.passthrough_alias!r}", aliases)
    return request


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
    rules: policy.Whitelist,
    platform: CloudPlatform,
) -> Plan:
    """Plan ``request`` on the node as it last reported itself, with the whitelist's ``rules``
    (:func:`gpumode.server.whitelist.rules`); a :class:`~gpumode.modes.policy.RequestError` or
    :class:`JobError` when it may not run.

    The platform is required, not optional: the host steps it asks for (:meth:`SwitchHooks.host_steps`,
    e.g. delivering nova-compute's configuration) are part of the plan, so a dry run shows exactly what a
    job runs, and no caller (a rollout, say) can plan a job that lacks them.
    """
    group = session.scalar(select(HostGroup.name).where(HostGroup.id == node.group_id))
    snapshot = HostSnapshot.from_dict(node.snapshot)
    plan = plan_switch(
        snapshot,
        stored_vms(node),
        request,
        catalog=catalog(),
        whitelist=rules,
        host_group=group if any(g.name == group for g in rules.groups) else None,
    )
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
