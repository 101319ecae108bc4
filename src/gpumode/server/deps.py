"""FastAPI dependencies: a database session per request and who the caller is."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy.orm import Session

from gpumode.cloud.base import CloudPlatform
from gpumode.server.audit import set_principal
from gpumode.server.auth import Principal, Role, authenticate, bearer_secret
from gpumode.server.state import ServerState


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.gpumode
    return state


def get_session(request: Request) -> Iterator[Session]:
    with server_state(request).sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
StateDep = Annotated[ServerState, Depends(server_state)]

_UNAUTHORIZED = HTTPException(
    status.HTTP_401_UNAUTHORIZED, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"}
)


def current_principal(request: Request, session: SessionDep) -> Principal:
    secret = bearer_secret(request.headers.get("authorization"))
    principal = authenticate(session, secret) if secret else None
    if principal is None:
        raise _UNAUTHORIZED
    set_principal(request, principal)
    return principal


PrincipalDep = Annotated[Principal, Depends(current_principal)]


def require(role: Role) -> Callable[[Principal], Principal]:
    """A dependency admitting ``role`` or higher (node tokens never pass)."""

    def check(principal: PrincipalDep) -> Principal:
        if not principal.at_least(role):
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"this call needs the {role.value} role or higher")
        return principal

    return check


Viewer = Annotated[Principal, Depends(require(Role.VIEWER))]
Operator = Annotated[Principal, Depends(require(Role.OPERATOR))]
Admin = Annotated[Principal, Depends(require(Role.ADMIN))]


def node_access(principal: Principal, node: str, *, users_need: Role) -> None:
    """A node token may act only for its own node; people need ``users_need``."""
    if principal.role is Role.NODE:
        if principal.node != node:
            raise HTTPException(
                status.HTTP_403_FORBIDDEN, f"this node token belongs to {principal.node}, not {node}"
            )
    elif not principal.at_least(users_need):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"this call needs the {users_need.value} role or higher"
        )


def platform(state: StateDep, session: SessionDep) -> CloudPlatform:
    return state.platform_factory(session)


PlatformDep = Annotated[CloudPlatform, Depends(platform)]
