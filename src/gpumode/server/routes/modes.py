"""The mode whitelist (method step 2): read by anyone with a token, replaced whole by admins."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, status

from gpumode.server import audit, whitelist
from gpumode.server.deps import Admin, SessionDep, Viewer
from gpumode.server.responses import errors
from gpumode.server.schemas import Whitelist

router = APIRouter(tags=["modes"])


@router.get("/modes", response_model=Whitelist)
def get_modes(_: Viewer, session: SessionDep) -> Whitelist:
    return whitelist.load(session)


@router.put(
    "/modes",
    responses=errors(409),
    response_model=Whitelist,
    summary="Replace the whitelist (platform, per group, per model)",
)
def put_modes(body: Whitelist, _: Admin, request: Request, session: SessionDep) -> Whitelist:
    try:
        whitelist.store(session, body)
    except whitelist.WhitelistError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from exc
    audit.commit_audited(request, session, target="modes", detail=body.model_dump_json())
    return whitelist.load(session)
