"""Operator changes to what the fleet is made of, one function each, for the API and the dashboard alike:
releasing a lost card, setting a host group's members, deleting a group. Each records its event or leaves the
audit to the caller (who knows the request); none commits."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from gpumode.cloud.base import Card, CardStatus, CloudPlatform
from gpumode.server import sync
from gpumode.server.models import HostGroup, ModeRule, Node
from gpumode.server.whitelist import GROUP


class FleetOpError(ValueError):
    """The change cannot be made; ``status`` is the HTTP status that says why (404, 409, 422)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def release_lost(session: Session, platform: CloudPlatform, card: Card) -> None:
    """A lost card (its device is gone) released by an operator: removed, with a ``card.released`` event."""
    if card.status is not CardStatus.LOST:
        raise FleetOpError(409, f"card {card.id} is {card.status.value}, not lost")
    platform.remove_cards([card.id])
    session.add(
        sync.make_event(
            card.node,
            "card.released",
            sync.Severity.INFO,
            card.device,
            f"lost {card.kind.value} card {card.id} released by an operator and removed",
            datetime.now(UTC),
            before={"status": card.status.value, "holder": card.holder},
        )
    )


def set_group(session: Session, name: str, nodes: list[str]) -> list[str]:
    """Create the host group ``name`` if needed and make ``nodes`` its only members (each leaves its old
    group); the members, sorted. Unknown nodes are refused and nothing changes."""
    wanted = sorted(set(nodes))
    found = {n.name for n in session.scalars(select(Node).where(Node.name.in_(wanted)))} if wanted else set()
    missing = [n for n in wanted if n not in found]
    if missing:
        raise FleetOpError(422, f"unknown node(s): {', '.join(missing)}")
    group = session.scalars(select(HostGroup).where(HostGroup.name == name)).first()
    if group is None:
        group = HostGroup(name=name, created_at=datetime.now(UTC))
        session.add(group)
        session.flush()
    session.execute(update(Node).where(Node.group_id == group.id).values(group_id=None))
    if wanted:
        session.execute(update(Node).where(Node.name.in_(wanted)).values(group_id=group.id))
    return wanted


def delete_group(session: Session, name: str) -> None:
    """Delete a host group and its whitelist rule; its nodes stay, in no group."""
    group = session.scalars(select(HostGroup).where(HostGroup.name == name)).first()
    if group is None:
        raise FleetOpError(404, f"no host group named {name!r}")
    session.execute(update(Node).where(Node.group_id == group.id).values(group_id=None))
    session.execute(delete(ModeRule).where(ModeRule.scope == GROUP, ModeRule.key == name))
    session.delete(group)


def group_members(session: Session) -> dict[str, list[str]]:
    """Every host group with its nodes, by name."""
    members: dict[str, list[str]] = {
        g: [] for g in session.scalars(select(HostGroup.name).order_by(HostGroup.name))
    }
    for node, group in session.execute(
        select(Node.name, HostGroup.name).join(HostGroup, HostGroup.id == Node.group_id).order_by(Node.name)
    ):
        members[group].append(node)
    return members
