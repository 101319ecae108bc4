"""Dashboard sessions over the API (admin): list the open ones, end one (its cookie stops working at once)."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, HTTPException, Request, status
from pydantic import BaseModel

from gpumode.server.audit import commit_audited
from gpumode.server.deps import Admin, SessionDep
from gpumode.server.responses import errors
from gpumode.server.schemas import RowId, Utc
from gpumode.server.web.session import end_session, open_sessions

router = APIRouter(tags=["sessions"])


class SessionOut(BaseModel):
    id: int
    user: str
    role: str
    token_id: int
    client: str | None
    created_at: Utc
    expires_at: Utc


@router.get("/sessions", response_model=list[SessionOut], summary="Open dashboard sessions, by user")
def list_sessions(_: Admin, session: SessionDep) -> list[SessionOut]:
    return [
        SessionOut.model_validate(s, from_attributes=True)
        for s in open_sessions(session, now=datetime.now(UTC))
    ]


@router.delete("/sessions/{session_id}", responses=errors(404, 409), status_code=status.HTTP_204_NO_CONTENT)
def end(session_id: RowId, who: Admin, request: Request, session: SessionDep) -> None:
    if not end_session(session, session_id, by=who.name, now=datetime.now(UTC)):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no open dashboard session {session_id}")
    commit_audited(
        request, session, target=f"session:{session_id}", status_code=204, detail="ended by an admin"
    )
