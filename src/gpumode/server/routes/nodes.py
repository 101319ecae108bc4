"""Nodes and host groups (hardware reports are in :mod:`gpumode.server.routes.reports`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Request, status
from sqlalchemy import select

from gpumode import wire
from gpumode.domain import HostSnapshot
from gpumode.server import audit, fleet_ops
from gpumode.server.auth import Principal, Role
from gpumode.server.deps import Operator, PlatformDep, PrincipalDep, SessionDep, StateDep, Viewer, node_access
from gpumode.server.models import HostGroup, Node
from gpumode.server.responses import errors
from gpumode.server.schemas import NAME_PATTERN, GroupOut, GroupPut, NodeDetail, NodeOut
from gpumode.server.state import ServerState

router = APIRouter(tags=["nodes"])


def _node_out(node: Node, group: str | None, state: ServerState) -> dict[str, Any]:
    return {
        "name": node.name,
        "group": group,
        "mode": node.mode,
        "driver_state": node.driver_state,
        "gpu_count": node.gpu_count,
        "fingerprint": node.fingerprint,
        "created_at": node.created_at,
        "changed_at": node.changed_at,
        "last_seen": state.last_seen.get(node.name),
        "agent_version": node.agent_version,
        "agent_protocol": node.agent_protocol,
        "agent_out_of_date": wire.out_of_date(node.agent_protocol),
    }


@router.get("/nodes", response_model=list[NodeOut])
def list_nodes(
    _: Viewer, session: SessionDep, state: StateDep, group: str | None = None, mode: str | None = None
) -> list[dict[str, Any]]:
    query = (
        select(Node, HostGroup.name).outerjoin(HostGroup, HostGroup.id == Node.group_id).order_by(Node.name)
    )
    if group is not None:
        query = query.where(HostGroup.name == group)
    if mode is not None:
        query = query.where(Node.mode == mode)
    return [_node_out(node, group_name, state) for node, group_name in session.execute(query)]


def _own_node_or(role: Role) -> Any:
    def check(name: str, principal: PrincipalDep) -> Principal:
        node_access(principal, name, users_need=role)
        return principal

    return check


@router.get("/nodes/{name}", responses=errors(404), response_model=NodeDetail)
def get_node(
    name: str,
    _: Annotated[Principal, Depends(_own_node_or(Role.VIEWER))],
    session: SessionDep,
    state: StateDep,
    platform: PlatformDep,
) -> dict[str, Any]:
    row = session.execute(
        select(Node, HostGroup.name)
        .outerjoin(HostGroup, HostGroup.id == Node.group_id)
        .where(Node.name == name)
    ).first()
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no node named {name!r}")
    node, group = row
    snap = HostSnapshot.from_dict(node.snapshot)
    gpus = [
        {
            "address": g.address,
            "name": g.name,
            "device": f"{g.device:04x}",
            "mode": g.mode.value,
            "driver": g.driver,
            "numa_node": g.numa_node,
            "iommu_group": g.iommu_group,
            "companions": g.companions,
            "vfs": g.vfs,
            "mdevs": g.mdevs,
            "vgpus": g.vgpus,
        }
        for g in snap.gpus
    ]
    nvidia = node.snapshot.get("nvidia", {})
    return {
        **_node_out(node, group, state),
        "kernel": snap.kernel,
        "nvidia": nvidia,
        "gpus": gpus,
        "nvswitches": snap.nvswitches,
        "problems": snap.problems,
        "cards": platform.list_cards(node=name),
    }


# --- host groups --------------------------------------------------------------------------------------------


@router.get("/groups", response_model=list[GroupOut])
def list_groups(_: Viewer, session: SessionDep) -> list[GroupOut]:
    return [GroupOut(name=g, nodes=n) for g, n in fleet_ops.group_members(session).items()]


@router.put(
    "/groups/{name}",
    responses=errors(409),
    response_model=GroupOut,
    summary="Create a host group or set its members",
)
def put_group(
    name: Annotated[str, Path(pattern=NAME_PATTERN)],
    body: GroupPut,
    _: Operator,
    request: Request,
    session: SessionDep,
) -> GroupOut:
    try:
        wanted = fleet_ops.set_group(session, name, body.nodes)
    except fleet_ops.FleetOpError as exc:
        raise HTTPException(exc.status, str(exc)) from exc
    audit.commit_audited(
        request, session, target=f"group:{name}", detail=f"members: {', '.join(wanted) or '-'}"
    )
    return GroupOut(name=name, nodes=wanted)


@router.delete("/groups/{name}", responses=errors(404, 409), status_code=status.HTTP_204_NO_CONTENT)
def delete_group(name: str, _: Operator, request: Request, session: SessionDep) -> None:
    try:
        fleet_ops.delete_group(session, name)
    except fleet_ops.FleetOpError as exc:
        raise HTTPException(exc.status, str(exc)) from exc
    audit.commit_audited(request, session, target=f"group:{name}", status_code=204)
