"""Who is using the dashboard, and what they may do: the session cookie, role checks, CSRF on forms.

Pages raise :class:`SignInNeeded` (→ redirect to the sign-in page) or :class:`Forbidden` (→ a 403 page); the
handlers are installed with the router (:mod:`gpumode.server.web`). Refused posts are written to the audit log
like refused API calls, so a viewer trying to switch a host is on record.
"""

from __future__ import annotations

import logging
from typing import Annotated
from urllib.parse import parse_qs

from fastapi import Depends, Request

from gpumode.server import audit
from gpumode.server.auth import Role
from gpumode.server.deps import SessionDep, server_state
from gpumode.server.web.session import COOKIE, SessionKeys, WebSession, csrf_ok

log = logging.getLogger(__name__)
MAX_FORM_BYTES = 64 * 1024


class SignInNeeded(Exception):
    """No valid session: the page answers with a redirect to the sign-in form."""


class Forbidden(Exception):
    """Signed in, but not allowed (role too low, bad CSRF token); the message says why."""


def keys(request: Request) -> SessionKeys:
    found: SessionKeys = request.app.state.gpumode_web_keys
    return found


def web_session(request: Request, session: SessionDep) -> WebSession:
    web = keys(request).resume(session, request.cookies.get(COOKIE))
    if web is None:
        raise SignInNeeded()
    audit.set_principal(request, web.principal)
    request.state.web = web
    return web


def signed_in(request: Request) -> WebSession | None:
    """The session this request was admitted with, if it got that far (for error pages)."""
    found: WebSession | None = getattr(request.state, "web", None)
    return found


WebUser = Annotated[WebSession, Depends(web_session)]


def require_role(request: Request, web: WebSession, role: Role) -> None:
    """Raise :class:`Forbidden` (and audit the refusal) unless the user holds ``role`` or higher."""
    if web.principal.at_least(role):
        return
    _audit_refusal(request, web, f"needs the {role.value} role")
    raise Forbidden(
        f"this needs the {role.value} role or higher; you are signed in as {web.principal.role.value}"
    )


async def read_form(request: Request, web: WebSession) -> dict[str, list[str]]:
    """The urlencoded form of a POST, after its CSRF token is checked. Multipart is not accepted: the
    dashboard's forms upload nothing."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type != "application/x-www-form-urlencoded":
        raise Forbidden(
            f"expected a form (application/x-www-form-urlencoded), not {content_type or 'nothing'}"
        )
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise Forbidden("the form is too large")
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True, max_num_fields=2000)
    if not csrf_ok(web, one(fields, "csrf")):
        _audit_refusal(request, web, "bad CSRF token")
        raise Forbidden("the form's CSRF token is missing or wrong; reload the page and try again")
    return fields


def one(fields: dict[str, list[str]], name: str) -> str | None:
    """A single form value, stripped; ``None`` when absent or blank."""
    values = fields.get(name)
    value = values[0].strip() if values else ""
    return value or None


def _audit_refusal(request: Request, web: WebSession, why: str) -> None:
    if request.method != "POST":
        return
    try:
        with server_state(request).sessions() as session:
            audit.record(
                session,
                actor=web.principal.name,
                role=web.principal.role.value,
                action=audit.action_of(request.scope),
                target=request.url.path,
                status_code=403,
                detail=why,
            )
            session.commit()
    except Exception:  # the refusal stands even if its record cannot be written
        log.exception("could not audit a refused dashboard post to %s", request.url.path)
