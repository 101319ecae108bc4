"""Sign-in, and the pages that only read: the fleet, one host, events and the audit log."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from gpumode.domain import HostSnapshot
from gpumode.server import audit
from gpumode.server.auth import Role
from gpumode.server.deps import SessionDep, StateDep
from gpumode.server.models import AuditEntry
from gpumode.server.schemas import RowId
from gpumode.server.state import ServerState
from gpumode.server.web import queries
from gpumode.server.web.access import WebUser, keys, read_form, require_role
from gpumode.server.web.render import page
from gpumode.server.web.session import (
    COOKIE,
    LIFETIME_S,
    SignInRefused,
    WebSession,
    cookie_secure,
    end_session,
    plain_http_allowed,
)

router = APIRouter(include_in_schema=False)
UI = "/ui"
Text = Annotated[str | None, Query(max_length=200)]


def _see_other(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=status.HTTP_303_SEE_OTHER)


@router.get("/")
def root() -> RedirectResponse:
    return _see_other(f"{UI}/")


@router.get(f"{UI}/login", response_class=HTMLResponse)
def login_form(request: Request) -> HTMLResponse:
    return page(request, None, "login.html", error=None, insecure=_insecure(request))


def _insecure(request: Request) -> bool:
    client = request.client.host if request.client else None
    return not plain_http_allowed(request.url.scheme, client)


@router.post(f"{UI}/login", response_model=None)
async def login(request: Request, state: StateDep) -> Response:
    """Exchange an API token for a session cookie. The form is not CSRF-checked (there is no session yet);
    SameSite=Strict and the token itself are what an attacker lacks."""
    if _insecure(request):
        return page(request, None, "login.html", 403, error="sign-in needs HTTPS here", insecure=True)
    from urllib.parse import parse_qs

    fields = parse_qs((await request.body())[:4096].decode("utf-8", "replace"))
    token = (fields.get("token") or [""])[0]
    try:
        web = await run_in_threadpool(_sign_in, request, state, token)
    except SignInRefused as exc:
        return page(request, None, "login.html", 401, error=str(exc), insecure=False)
    response = _see_other(f"{UI}/")
    response.set_cookie(
        COOKIE,
        web.cookie,
        max_age=LIFETIME_S,
        path="/",
        secure=cookie_secure(request.url.scheme),
        httponly=True,
        samesite="strict",
    )
    return response


def _sign_in(request: Request, state: ServerState, token: str) -> WebSession:
    """A new session (its row and audit entry committed together)."""
    with state.sessions() as session:
        web = keys(request).sign_in(session, token, client=request.client.host if request.client else None)
        audit.set_principal(request, web.principal)
        audit.commit_audited(request, session, target=f"session:{web.session_id}", detail="signed in")
    return web


@router.post(f"{UI}/logout")
async def logout(request: Request, web: WebUser, state: StateDep) -> RedirectResponse:
    """Sign out: the session ends on the server, so the cookie is worthless even if it was copied."""
    await read_form(request, web)
    await run_in_threadpool(_sign_out, request, state, web)
    response = _see_other(f"{UI}/login")
    response.delete_cookie(
        COOKIE, path="/", secure=cookie_secure(request.url.scheme), httponly=True, samesite="strict"
    )
    return response


def _sign_out(request: Request, state: ServerState, web: WebSession) -> None:
    with state.sessions() as session:
        end_session(session, web.session_id, by=web.principal.name, now=datetime.now(UTC))
        audit.commit_audited(request, session, target=f"session:{web.session_id}", detail="signed out")


@router.get(f"{UI}/", response_class=HTMLResponse)
def fleet(
    request: Request,
    web: WebUser,
    session: SessionDep,
    state: StateDep,
    mode: Annotated[str | None, Query(max_length=16)] = None,
    model: Annotated[str | None, Query(pattern=r"^[0-9a-f]{4}:[0-9a-f]{4}$")] = None,
    group: Annotated[str | None, Query(max_length=64)] = None,
    page_no: Annotated[int, Query(alias="page", ge=1, le=1_000_000)] = 1,
) -> HTMLResponse:
    f = queries.FleetFilter(mode=mode or None, model=model or None, group=group or None, page=page_no)
    fleet_page = queries.fleet_page(session, state.platform_factory(session), f, dict(state.last_seen))
    return page(request, web, "fleet.html", nav="fleet", fleet=fleet_page, f=f, modes=queries.MODES)


@router.get(UI + "/nodes/{name}", response_class=HTMLResponse)
def host(request: Request, name: str, web: WebUser, session: SessionDep, state: StateDep) -> HTMLResponse:
    detail = queries.host_detail(session, state.platform_factory(session), name, state.last_seen.get(name))
    if detail is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no node named {name!r}")
    snap = HostSnapshot.from_dict(detail.node.snapshot)
    return page(request, web, "host.html", nav="fleet", d=detail, snap=snap)


@router.get(f"{UI}/events", response_class=HTMLResponse)
def events(
    request: Request,
    web: WebUser,
    session: SessionDep,
    q: Text = None,
    node: Text = None,
    kind: Text = None,
    severity: Annotated[str | None, Query(max_length=16)] = None,
    before_id: RowId | None = None,
) -> HTMLResponse:
    found = queries.search_events(
        session, q=q, node=node or None, kind=kind or None, severity=severity or None, before_id=before_id
    )
    more = found[-1].id if len(found) == queries.PAGE_SIZE else None
    args = {"q": q or "", "node": node or "", "kind": kind or "", "severity": severity or ""}
    return page(request, web, "events.html", nav="events", events=found, args=args, more=more)


@router.get(f"{UI}/audit", response_class=HTMLResponse)
def audit_log(
    request: Request,
    web: WebUser,
    session: SessionDep,
    q: Text = None,
    actor: Text = None,
    before_id: RowId | None = None,
    people: bool = False,
) -> HTMLResponse:
    require_role(request, web, Role.ADMIN)
    found = queries.search_audit(session, q=q, actor=actor or None, before_id=before_id, people=people)
    more = found[-1].id if len(found) == queries.PAGE_SIZE else None
    actors = list(session.scalars(select(AuditEntry.actor).distinct().order_by(AuditEntry.actor).limit(200)))
    args = {"q": q or "", "actor": actor or "", "people": "1" if people else ""}
    return page(request, web, "audit.html", nav="audit", entries=found, args=args, more=more, actors=actors)
