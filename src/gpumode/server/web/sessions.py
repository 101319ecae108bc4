"""Dashboard sessions for admins: who is signed in, from where, until when; and ending a session, which makes
its cookie worthless at once (``web_sessions``, :mod:`gpumode.server.web.session`)."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import groupby

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.concurrency import run_in_threadpool

from gpumode.server import audit
from gpumode.server.auth import Role
from gpumode.server.deps import SessionDep, StateDep
from gpumode.server.schemas import RowId
from gpumode.server.state import ServerState
from gpumode.server.web.access import WebUser, read_form, require_role
from gpumode.server.web.render import page
from gpumode.server.web.session import WebSession, end_session, open_sessions

router = APIRouter(include_in_schema=False)
UI = "/ui"
PAGE = f"{UI}/sessions"


@router.get(PAGE, response_class=HTMLResponse)
def show(request: Request, web: WebUser, session: SessionDep) -> HTMLResponse:
    require_role(request, web, Role.ADMIN)
    found = open_sessions(session, now=datetime.now(UTC))
    users = [(user, list(rows)) for user, rows in groupby(found, key=lambda s: s.user)]
    return page(request, web, "sessions.html", nav="sessions", users=users, mine=web.session_id)


@router.post(PAGE + "/{session_id}/end")
async def end(request: Request, session_id: RowId, web: WebUser, state: StateDep) -> RedirectResponse:
    require_role(request, web, Role.ADMIN)
    await read_form(request, web)
    await run_in_threadpool(_end, request, state, web, session_id)
    return RedirectResponse(PAGE, status_code=status.HTTP_303_SEE_OTHER)


def _end(request: Request, state: ServerState, web: WebSession, session_id: int) -> None:
    with state.sessions() as session:
        if not end_session(session, session_id, by=web.principal.name, now=datetime.now(UTC)):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no open dashboard session {session_id}")
        audit.commit_audited(request, session, target=f"session:{session_id}", detail="ended by an admin")
