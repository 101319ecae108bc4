"""The web dashboard: server-rendered pages under ``/ui`` over the same database, roles and jobs as the API.

:func:`install` adds it to the app: its routes, its static files (vendored; nothing is fetched from the
internet), the session key, and the handlers that turn "not signed in" into a redirect and "not allowed" into
a 403 page. See ``docs/dashboard.md``.
"""

from __future__ import annotations

from fastapi import FastAPI, Request, status
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpumode.server.web import admin, fleet_ops, pages, rollouts, sessions, switch
from gpumode.server.web.access import Forbidden, SignInNeeded, signed_in
from gpumode.server.web.render import HERE, page
from gpumode.server.web.session import SessionKeys

UI = "/ui"


def install(app: FastAPI, session_key: str | None = None) -> None:
    """Serve the dashboard from ``app``. ``session_key`` overrides ``GPUMODE_WEB_SESSION_KEY``."""
    app.state.gpumode_web_keys = SessionKeys(session_key)
    for module in (pages, switch, rollouts, admin, sessions, fleet_ops):
        app.include_router(module.router)
    app.mount(f"{UI}/static", StaticFiles(directory=HERE / "static"), name="ui-static")
    app.add_exception_handler(SignInNeeded, _sign_in)
    app.add_exception_handler(Forbidden, _forbidden)
    app.add_exception_handler(StarletteHTTPException, _http_error)


async def _sign_in(request: Request, _: Exception) -> Response:
    """Pages send the browser to the sign-in form; posts and event streams just answer 401."""
    if request.method == "GET" and not request.url.path.endswith("/stream"):
        return RedirectResponse(f"{UI}/login", status_code=status.HTTP_303_SEE_OTHER)
    return Response("sign in first", status_code=status.HTTP_401_UNAUTHORIZED)


async def _forbidden(request: Request, exc: Exception) -> HTMLResponse:
    return page(
        request,
        signed_in(request),
        "error.html",
        status.HTTP_403_FORBIDDEN,
        title="Not allowed",
        message=str(exc),
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    """Dashboard errors as pages; the API keeps its JSON errors."""
    assert isinstance(exc, StarletteHTTPException)
    if not request.url.path.startswith(f"{UI}/"):
        return await http_exception_handler(request, exc)
    title = {404: "Not found", 409: "Conflict", 403: "Not allowed"}.get(exc.status_code, "Error")
    return page(
        request, signed_in(request), "error.html", exc.status_code, title=title, message=str(exc.detail)
    )
