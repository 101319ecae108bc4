"""Joining: an agent trades a join token (and its first snapshot) for a node token bound to its node."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, status
from sqlalchemy import select, update

from gpumode.server import card_holders, joining, sync
from gpumode.server.audit import commit_audited, set_principal
from gpumode.server.auth import (
    JoinRefused,
    Principal,
    Role,
    bearer_secret,
    create_node_token,
    hash_secret,
    redeem_join_token,
)
from gpumode.server.deps import Admin, PlatformDep, SessionDep, StateDep
from gpumode.server.models import ApiToken, JoinToken, Node
from gpumode.server.responses import errors
from gpumode.server.schemas import JoinRequest, JoinResponse, ReplaceOut
from gpumode.server.snapshot import Hostname

router = APIRouter(tags=["agents"])

_REFUSED = HTTPException(
    status.HTTP_401_UNAUTHORIZED,
    "missing, unknown, expired, revoked or used-up join token",
    headers={"WWW-Authenticate": "Bearer"},
)


def join_secret(request: Request, session: SessionDep) -> str:
    """Checked before the body is read, so a wrong token is a 401 whatever the body holds."""
    secret = bearer_secret(request.headers.get("authorization"))
    if secret is None:
        raise _REFUSED
    token = session.scalars(select(JoinToken).where(JoinToken.token_hash == hash_secret(secret))).first()
    if token is None:
        raise _REFUSED
    set_principal(request, Principal(token_id=token.id, name=f"join:{token.name}", role=Role.NODE))
    return secret


@router.post(
    "/agents/join",
    responses=errors(409),
    response_model=JoinResponse,
    status_code=status.HTTP_201_CREATED,
    summary="Exchange a join token and a first snapshot for a node token",
)
def join(
    body: JoinRequest,
    secret: Annotated[str, Depends(join_secret)],
    request: Request,
    session: SessionDep,
    platform: PlatformDep,
    state: StateDep,
) -> JoinResponse:
    snapshot = body.snapshot.to_domain()
    if snapshot.hostname != body.hostname:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"hostname {body.hostname!r} does not match the snapshot's {snapshot.hostname!r}",
        )
    now = datetime.now(UTC)
    try:
        join_token = redeem_join_token(session, secret, now=now)
    except JoinRefused as exc:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, str(exc), headers={"WWW-Authenticate": "Bearer"}
        ) from exc
    node = session.scalars(select(Node).where(Node.name == body.hostname).with_for_update()).first()
    rejoin, proof = node is not None, ""
    if node is not None:
        try:
            proof = joining.rejoin_proof(session, node, body.node_token, now)
        except joining.RejoinRefused as exc:
            raise HTTPException(
                status.HTTP_409_CONFLICT, {"code": "node_exists", "message": str(exc)}
            ) from exc
        # The agent re-joined (or its replacement did): the node's old tokens stop working now.
        session.execute(update(ApiToken).where(ApiToken.node_id == node.id).values(revoked=True))
        session.add(
            sync.make_event(
                node.name,
                "node.rejoined",
                sync.Severity.WARNING,
                None,
                f"node {node.name} joined again with join token {join_token.name!r} ({proof}); "
                "its previous node tokens are revoked",
                now,
            )
        )
    if node is None or node.fingerprint != snapshot.fingerprint:
        node, result = sync.apply_snapshot(session, platform, snapshot, now=now, node=node)
        summary = result.summary()
    else:
        summary = sync.SyncResult(node=node.name, changed=False).summary()
    if body.snapshot.vms is not None:
        node.vms = body.snapshot.vms_json()
    session.add_all(card_holders.follow_vms(platform, node.name, node.vms, now))

    _, node_secret = create_node_token(session, node, created_by=f"join:{join_token.name}")
    # Two agents joining one new hostname at once (on two servers, say): the database refuses the second
    # insert, here or in the sync above, and gpumode.server.conflicts answers 409 with a retry hint.
    commit_audited(
        request,
        session,
        target=f"node:{node.name}",
        status_code=201,
        detail=(f"rejoined ({proof})" if rejoin else "joined") + f" with join token {join_token.name!r}",
    )
    state.seen(node.name, now)
    return JoinResponse(node=node.name, token=node_secret, sync=summary)


@router.post(
    "/nodes/{name}/replace",
    responses=errors(404, 409),
    response_model=ReplaceOut,
    summary="Allow a new host to take a node over",
)
def allow_replacement(name: Hostname, who: Admin, request: Request, session: SessionDep) -> ReplaceOut:
    """The next join under ``name`` (within 24 h, with any valid join token) takes the node over without
    its current node token: for a host reinstalled or replaced that lost it. The node's tokens keep
    working until that join."""
    try:
        node = joining.allow_replacement(session, name, by=who.name, now=datetime.now(UTC))
    except joining.UnknownNode as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
    assert node.replace_until is not None
    answer = ReplaceOut(node=node.name, replace_until=node.replace_until, replace_by=who.name)
    commit_audited(
        request, session, target=f"node:{node.name}", detail=f"replacement allowed until {node.replace_until}"
    )
    return answer
