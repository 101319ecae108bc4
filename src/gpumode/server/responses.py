"""The error answers of the API, as the OpenAPI document shows them: one body model for every error status
and the words for each, so each route lists the statuses it can answer with (``responses=errors(404, 409)``)
and the document says exactly what the server does."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorOut(BaseModel):
    """Every error body: ``detail`` is a message, a structured refusal (``code``, ``message``, …) or, for
    invalid input, a list of ``{"loc", "msg", "type"}``."""

    detail: str | dict[str, Any] | list[dict[str, Any]] = Field(description="what was wrong")


_WHY = {
    401: "missing, unknown or revoked token",
    403: "the token's role (or node) may not do this",
    404: "no such thing (the message names it)",
    409: "conflicts with the current state, or a concurrent request won (then `Retry-After` says when to "
    "retry)",
    413: "the body is larger than the server's `max_body_bytes`",
    422: "invalid input: where and what, or why the request may not be carried out",
    426: "the agent's protocol (`X-Gpumode-Protocol`) is not served here: upgrade gpumode on the host",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each status with :class:`ErrorOut` and what it means."""
    return {code: {"model": ErrorOut, "description": _WHY[code]} for code in codes}


# What any authenticated route under /api/v1 may answer (added where the routers are included).
AUTHENTICATED = errors(401, 403, 413, 422)
