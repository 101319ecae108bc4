"""Jinja2 templates: one environment for the dashboard, autoescaped, with a few display filters."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape

from gpumode.orm import as_utc
from gpumode.server.auth import Role
from gpumode.server.web.session import WebSession

HERE = Path(__file__).parent
_ENV = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)


def _ago(value: datetime | str | None) -> str:
    """ "12 s ago" / "3 min ago" / a date: how fresh a report is matters more than its exact time."""
    if value is None:
        return "never"
    when = as_utc(datetime.fromisoformat(value) if isinstance(value, str) else value)
    seconds = int((datetime.now(UTC) - when).total_seconds())
    if seconds < 0:
        return "just now"
    if seconds < 90:
        return f"{seconds} s ago"
    if seconds < 90 * 60:
        return f"{seconds // 60} min ago"
    if seconds < 36 * 3600:
        return f"{seconds // 3600} h ago"
    return when.strftime("%Y-%m-%d %H:%M")


def _when(value: datetime | str | None) -> str:
    if value is None:
        return "–"
    when = as_utc(datetime.fromisoformat(value) if isinstance(value, str) else value)
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(start: datetime | str | None, end: datetime | str | None) -> str:
    """A step's or job's duration; a running one counts up to now."""
    if start is None:
        return ""
    first = as_utc(datetime.fromisoformat(start) if isinstance(start, str) else start)
    last = as_utc(datetime.fromisoformat(end) if isinstance(end, str) else end) if end else datetime.now(UTC)
    seconds = max(0.0, (last - first).total_seconds())
    return f"{seconds:.1f} s" if seconds < 60 else f"{int(seconds // 60)} min {int(seconds % 60)} s"


_ENV.filters["ago"] = _ago
_ENV.filters["when"] = _when
_ENV.globals["duration"] = duration


def page(
    request: Request, web: WebSession | None, template: str, status_code: int = 200, **context: Any
) -> HTMLResponse:
    """Render a page with what every page needs: who is signed in, what they may do, the CSRF token."""
    principal = web.principal if web else None
    html = _ENV.get_template(template).render(
        request=request,
        user=principal,
        csrf=web.csrf if web else "",
        can_operate=bool(principal and principal.at_least(Role.OPERATOR)),
        is_admin=bool(principal and principal.at_least(Role.ADMIN)),
        **context,
    )
    # Pages show live fleet state and carry CSRF tokens: never cache them, never frame them.
    return HTMLResponse(
        html,
        status_code=status_code,
        headers={
            "Cache-Control": "no-store",
            "X-Frame-Options": "DENY",
            "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'",
            "Referrer-Policy": "same-origin",
        },
    )
