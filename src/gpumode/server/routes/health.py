"""Liveness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response, status
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from gpumode.server.auth import Role, authenticate, bearer_secret
from gpumode.server.deps import SessionDep, StateDep

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the server runs and its database answers (no token needed)")
def healthz(session: SessionDep) -> dict[str, str]:
    session.execute(text("SELECT 1"))
    return {"status": "ok"}


@router.get(
    "/metrics", response_class=Response, summary="Prometheus metrics (viewer+, unless metrics_public)"
)
def metrics(request: Request, state: StateDep, session: SessionDep) -> Response:
    if not state.settings.metrics_public:
        secret = bearer_secret(request.headers.get("authorization"))
        principal = authenticate(session, secret) if secret else None
        if principal is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "missing or invalid bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not principal.at_least(Role.VIEWER):
            raise HTTPException(status.HTTP_403_FORBIDDEN, "metrics need the viewer role or higher")
    session.close()  # the inventory collector opens its own session
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
