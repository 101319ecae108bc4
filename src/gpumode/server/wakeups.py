"""Waking an agent's long poll in this process the moment it has work (a new job, a cancel).

A poll in another server process finds the work anyway, at its next look at the database
(:data:`gpumode.server.routes.work.POLL_S`); this only saves that wait.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Wakeups:
    """Wakes the long polls of one node waiting in this process (set from worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}

    @contextmanager
    def waiter(self, node: str) -> Iterator[asyncio.Event]:
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiting.setdefault(node, set()).add(entry)
        try:
            yield entry[1]
        finally:
            with self._lock:
                waiting = self._waiting.get(node)
                if waiting is not None:
                    waiting.discard(entry)
                    if not waiting:
                        del self._waiting[node]

    def notify(self, node: str) -> None:
        with self._lock:
            entries = list(self._waiting.get(node, ()))
        for loop, event in entries:
            loop.call_soon_threadsafe(event.set)
