"""What a rollout preview shows of a whole host group without planning each member.

Planning a host decodes its stored snapshot and runs the planner (a millisecond or two), so a preview plans
one page of members at a time; the figures for the whole group come from SQL instead: members and their
modes, GPUs per current mode (``node_gpus``), the VMs their agents last reported, members already busy with a
job, and the members the whitelist refuses. The whitelist check repeats the levels of
:func:`gpumode.modes.policy.allowed_modes` that need no snapshot — platform, host group, GPU model, for every
GPU of a host, as a dashboard rollout names no GPUs — so it names refusals before any member is planned; the
rest (IOMMU groups, vGPU types, what the host can hold together) is checked per page and again, for every
member, when the rollout is confirmed.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import distinct, func, select, text
from sqlalchemy.orm import Session

from gpumode.domain import Mode
from gpumode.server.models import HostGroup, Job, Node, NodeGpu
from gpumode.server.schemas import Whitelist
from gpumode.server.switch.errors import NotFound
from gpumode.server.switch.states import ACTIVE_STATES

NAMED = 20  # refused members named on the page; the rest are counted


# VMs per member from the stored VM lists (JSON arrays; a node that reported none holds JSON null). Counted
# by the database: reading every member's list would cost as much as the page itself on a large group.
_VMS_SQL = {
    "sqlite": """
        SELECT count(*), coalesce(sum(json_extract(vm.value, '$.running') = 1), 0),
               count(DISTINCT nodes.id)
        FROM nodes, json_each(CASE WHEN json_type(nodes.vms) = 'array' THEN nodes.vms ELSE '[]' END) AS vm
        WHERE nodes.group_id = :group_id""",
    "postgresql": """
        SELECT count(*), count(*) FILTER (WHERE vm ->> 'running' = 'true'), count(DISTINCT nodes.id)
        FROM nodes, jsonb_array_elements(
            CASE WHEN jsonb_typeof(nodes.vms) = 'array' THEN nodes.vms ELSE '[]'::jsonb END) AS vm
        WHERE nodes.group_id = :group_id""",
}


@dataclass(frozen=True, slots=True)
class GroupFigures:
    members: int
    hosts_by_mode: dict[str, int]
    gpus_by_mode: dict[str, int]
    vms: int  # reported on the members, running or not
    vms_running: int
    hosts_with_vms: int
    busy: int  # members with a job queued or running: their rollout job would be blocked
    refused: int  # members the whitelist refuses the mode on
    refused_named: list[tuple[str, str]]  # the first NAMED of them, with the reason


def group_id(session: Session, group: str) -> int:
    """The group's id; :class:`NotFound` (worded as :func:`rollouts.members` words it) when unknown."""
    found = session.scalar(select(HostGroup.id).where(HostGroup.name == group))
    if found is None:
        raise NotFound(f"no host group named {group!r}")
    return found


def member_page(session: Session, gid: int, page: int, page_size: int) -> list[Node]:
    """One page of the group's members in the order a rollout starts them (by name)."""
    return list(
        session.scalars(
            select(Node)
            .where(Node.group_id == gid)
            .order_by(Node.name)
            .limit(page_size)
            .offset((page - 1) * page_size)
        )
    )


def figures(session: Session, gid: int, group: str, mode: Mode, rules: Whitelist) -> GroupFigures:
    in_group = Node.group_id == gid
    hosts_by_mode = dict(
        session.execute(select(Node.mode, func.count()).where(in_group).group_by(Node.mode)).all()
    )
    gpus_by_mode = dict(
        session.execute(
            select(NodeGpu.mode, func.count())
            .join(Node, Node.id == NodeGpu.node_id)
            .where(in_group)
            .group_by(NodeGpu.mode)
        ).all()
    )
    dialect = session.get_bind().dialect.name
    vms, running, with_vms = session.execute(text(_VMS_SQL[dialect]), {"group_id": gid}).one()
    busy = session.scalar(
        select(func.count(distinct(Job.node_id)))
        .join(Node, Node.id == Job.node_id)
        .where(in_group, Job.state.in_(ACTIVE_STATES))
    )
    refused, named = _refused(session, gid, group, mode, rules)
    return GroupFigures(
        members=sum(hosts_by_mode.values()),
        hosts_by_mode=hosts_by_mode,
        gpus_by_mode=gpus_by_mode,
        vms=int(vms),
        vms_running=int(running),
        hosts_with_vms=int(with_vms),
        busy=busy or 0,
        refused=refused,
        refused_named=named,
    )


def _refused(
    session: Session, gid: int, group: str, mode: Mode, rules: Whitelist
) -> tuple[int, list[tuple[str, str]]]:
    """Members the whitelist refuses ``mode`` on: all of them at the platform or group level, else those
    with a GPU of a model whose rule leaves the mode out (only NVIDIA models' rules apply, as in
    :func:`gpumode.server.whitelist.rules`)."""
    members = select(Node.name).where(Node.group_id == gid).order_by(Node.name)
    if mode not in rules.platform:
        why = "disabled platform-wide"
    elif group in rules.groups and mode not in rules.groups[group]:
        why = f"disabled for host group {group!r}"
    else:
        banned = sorted(k for k, modes in rules.models.items() if k.startswith("10de:") and mode not in modes)
        if not banned:
            return 0, []
        hits = (
            select(Node.name, func.min(NodeGpu.model).label("model"))
            .join(NodeGpu, NodeGpu.node_id == Node.id)
            .where(Node.group_id == gid, NodeGpu.model.in_(banned))
            .group_by(Node.name)
        )
        count = session.scalar(select(func.count()).select_from(hits.subquery())) or 0
        named = [
            (name, f"disabled for GPU model {model}")
            for name, model in session.execute(hits.order_by(Node.name).limit(NAMED)).all()
        ]
        return count, named
    count = session.scalar(select(func.count()).where(Node.group_id == gid)) or 0
    return count, [(name, why) for name in session.scalars(members.limit(NAMED))]
