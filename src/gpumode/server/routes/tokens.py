"""API tokens (people and tools) and join tokens (agents); admin only. Secrets are shown once, at creation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, HTTPException, Request, status
from sqlalchemy import select

from gpumode.server.audit import commit_audited
from gpumode.server.auth import create_join_token as issue_join_token
from gpumode.server.auth import create_user_token
from gpumode.server.deps import Admin, SessionDep, StateDep
from gpumode.server.models import ApiToken, JoinToken, Node
from gpumode.server.responses import errors
from gpumode.server.schemas import (
    JoinTokenCreate,
    JoinTokenCreated,
    JoinTokenOut,
    RowId,
    TokenCreate,
    TokenCreated,
    TokenOut,
)

router = APIRouter(tags=["tokens"])


def _token_out(token: ApiToken, node: str | None) -> dict[str, object]:
    return {
        "id": token.id,
        "name": token.name,
        "role": token.role,
        "node": node,
        "revoked": token.revoked,
        "created_at": token.created_at,
        "created_by": token.created_by,
    }


def _join_out(token: JoinToken) -> dict[str, object]:
    return {
        "id": token.id,
        "name": token.name,
        "uses": token.uses,
        "uses_left": token.uses_left,
        "expires_at": token.expires_at,
        "revoked": token.revoked,
        "created_at": token.created_at,
        "created_by": token.created_by,
    }


@router.get("/tokens", response_model=list[TokenOut])
def list_tokens(_: Admin, session: SessionDep) -> list[dict[str, object]]:
    rows = session.execute(
        select(ApiToken, Node.name).outerjoin(Node, Node.id == ApiToken.node_id).order_by(ApiToken.id)
    )
    return [_token_out(token, node) for token, node in rows]


@router.post(
    "/tokens", responses=errors(409), response_model=TokenCreated, status_code=status.HTTP_201_CREATED
)
def create_token(body: TokenCreate, who: Admin, request: Request, session: SessionDep) -> dict[str, object]:
    token, secret = create_user_token(session, body.name, body.role, created_by=who.name)
    commit_audited(
        request,
        session,
        target=f"token:{token.id}",
        status_code=201,
        detail=f"{body.role.value} token {body.name!r}",
    )
    return {**_token_out(token, None), "token": secret}


@router.delete("/tokens/{token_id}", responses=errors(404, 409), response_model=TokenOut)
def revoke_token(token_id: RowId, who: Admin, request: Request, session: SessionDep) -> dict[str, object]:
    token = session.get(ApiToken, token_id)
    if token is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no token with id {token_id}")
    if token.id == who.token_id:
        raise HTTPException(status.HTTP_409_CONFLICT, "refusing to revoke the token this call is made with")
    token.revoked = True
    node = session.get(Node, token.node_id) if token.node_id else None
    commit_audited(request, session, target=f"token:{token.id}", detail=f"revoked {token.name!r}")
    return _token_out(token, node.name if node else None)


@router.get("/join-tokens", response_model=list[JoinTokenOut])
def list_join_tokens(_: Admin, session: SessionDep) -> list[dict[str, object]]:
    return [_join_out(t) for t in session.scalars(select(JoinToken).order_by(JoinToken.id))]


@router.post(
    "/join-tokens",
    responses=errors(409),
    response_model=JoinTokenCreated,
    status_code=status.HTTP_201_CREATED,
)
def create_join_token(
    body: JoinTokenCreate, who: Admin, request: Request, session: SessionDep, state: StateDep
) -> dict[str, object]:
    token, secret = issue_join_token(
        session,
        body.name,
        uses=body.uses,
        ttl=timedelta(seconds=body.expires_in_s),
        created_by=who.name,
        now=datetime.now(UTC),
    )
    commit_audited(
        request,
        session,
        target=f"join-token:{token.id}",
        status_code=201,
        detail=f"join token {body.name!r}, {body.uses} use(s), expires in {body.expires_in_s} s",
    )
    return {
        **_join_out(token),
        "token": secret,
        "join_command": f"gpumode agent --server {state.settings.advertised_url} --token {secret}",
    }


@router.delete("/join-tokens/{token_id}", responses=errors(404, 409), response_model=JoinTokenOut)
def revoke_join_token(token_id: RowId, _: Admin, request: Request, session: SessionDep) -> dict[str, object]:
    token = session.get(JoinToken, token_id)
    if token is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no join token with id {token_id}")
    token.revoked = True
    commit_audited(request, session, target=f"join-token:{token.id}", detail=f"revoked {token.name!r}")
    return _join_out(token)
