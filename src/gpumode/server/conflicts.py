"""Races between server processes on one database end as **409** with a retry hint, never as 500.

Two servers (or two workers) may both decide a row is missing and insert it, or be chosen as the loser of a
serialization or deadlock check. The database refuses one of them, and the refused request's transaction is
rolled back whole, so nothing of it is stored: the caller may simply retry (``Retry-After``), and the retry
sees what the winner stored (a join then finds the node and asks for proof of identity, say).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, IntegrityError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
# PostgreSQL's SQLSTATEs for a transaction chosen to lose a race: serialization_failure, deadlock_detected.
LOST_RACE = frozenset({"40001", "40P01"})


def lost_race(exc: BaseException) -> bool:
    """Whether ``exc`` is the database refusing this transaction because a concurrent one won."""
    if isinstance(exc, IntegrityError):
        return True
    return isinstance(exc, DBAPIError) and getattr(exc.orig, "sqlstate", None) in LOST_RACE


def install(app: FastAPI) -> None:
    app.add_exception_handler(DBAPIError, _database_refused)


async def _database_refused(request: Request, exc: Exception) -> JSONResponse:
    if not lost_race(exc):
        log.exception("database error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse({"detail": "internal error; see the server log"}, status_code=500)
    orig = getattr(exc, "orig", exc)
    log.warning("%s %s lost a race with a concurrent request: %s", request.method, request.url.path, orig)
    return JSONResponse(
        {
            "detail": {
                "code": "concurrent_change",
                "message": "a concurrent request changed the same records first; nothing of this one was "
                f"stored: retry in {RETRY_AFTER_S} s",
                "retry_after_s": RETRY_AFTER_S,
            }
        },
        status_code=409,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )
