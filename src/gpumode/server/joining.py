"""Who may take over a node that has joined before: the node itself (its current node token) or the host an
admin said replaces it. A join token alone must not hand anyone the credentials of a node in the fleet."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpumode.server.auth import Role, authenticate
from gpumode.server.models import Node

# How long an admin's "replace this node" waits for the replacement to join.
REPLACE_WINDOW = timedelta(hours=24)


class RejoinRefused(Exception):
    """A join under the name of an existing node without proof; the message says what to do."""


class UnknownNode(LookupError):
    pass


def rejoin_proof(session: Session, node: Node, node_token: str | None, now: datetime) -> str:
    """Why a join may take over ``node`` (in words, for its event and audit entry): the caller shows the
    node's current token, or an admin allowed its replacement (used up here). Raises
    :class:`RejoinRefused` otherwise."""
    if node_token is not None:
        principal = authenticate(session, node_token)
        if principal is not None and principal.role is Role.NODE and principal.node == node.name:
            return "with its current node token"
    until = node.replace_until
    if until is not None and (until if until.tzinfo else until.replace(tzinfo=UTC)) > now:
        by = node.replace_by
        node.replace_until = node.replace_by = None
        return f"replacement allowed by {by}"
    what = "the node token given is not its current one" if node_token else "no node token was given"
    raise RejoinRefused(
        f"node {node.name} has joined before and {what}; re-joining needs its current node token, or an "
        f"admin allowing its replacement first (gpumode token replace {node.name})"
    )


def allow_replacement(session: Session, name: str, *, by: str, now: datetime) -> Node:
    """Let the next join under ``name`` within :data:`REPLACE_WINDOW` take the node over without its node
    token (a host reinstalled or replaced that lost it). Its tokens keep working until that join. The
    caller commits (audited)."""
    node = session.scalars(select(Node).where(Node.name == name).with_for_update()).first()
    if node is None:
        raise UnknownNode(f"no node named {name}")
    node.replace_until = now + REPLACE_WINDOW
    node.replace_by = by
    return node
