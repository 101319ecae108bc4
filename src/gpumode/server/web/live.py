"""Server-sent events for pages that follow something live (a job, a rollout) until it is over.

The stream looks at the database every :data:`POLL_S` and sends the page's view whenever it changed, then
``event: end`` once the view says it is over. The page script only paints what it is sent: the page and its
updates are made by the same function, so they cannot disagree.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

POLL_S = 0.4  # how often a stream looks: well under a step's duration
HEARTBEAT_S = 15.0  # keeps proxies from closing a quiet stream


def stream(
    request: Request,
    read: Callable[[], dict[str, Any]],
    *,
    over: Callable[[dict[str, Any]], bool],
    key: Callable[[dict[str, Any]], str] | None = None,
) -> StreamingResponse:
    """``read`` (run in a worker thread) returns the view; ``over`` says the stream may end; ``key`` what of
    the view counts as a change (default: all of it), so ticking durations are not sent as news."""
    return StreamingResponse(
        _events(request, read, over, key or _whole),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


def _whole(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, default=str)


async def _events(
    request: Request,
    read: Callable[[], dict[str, Any]],
    over: Callable[[dict[str, Any]], bool],
    key: Callable[[dict[str, Any]], str],
) -> AsyncIterator[str]:
    last: str | None = None
    quiet = 0.0
    while True:
        data = await run_in_threadpool(read)
        done = over(data)
        seen = key(data)
        if seen != last or done:
            last, quiet = seen, 0.0
            yield f"data: {json.dumps(data, default=str)}\n\n"
        elif quiet >= HEARTBEAT_S:
            quiet = 0.0
            yield ": still here\n\n"
        if done:
            yield "event: end\ndata: {}\n\n"
            return
        if await request.is_disconnected():
            return
        await asyncio.sleep(POLL_S)
        quiet += POLL_S
