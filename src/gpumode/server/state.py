"""What the running server holds in memory: settings, database handles, metrics, liveness, wake-ups."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from gpumode.cloud.base import CloudPlatform
from gpumode.cloud.embedded import EmbeddedPlatform
from gpumode.server import db
from gpumode.server.metrics import Metrics
from gpumode.server.settings import Settings
from gpumode.server.wakeups import Wakeups


def select_platform(settings: Settings) -> Callable[[Session], CloudPlatform]:
    """The cloud platform the settings name (``cloud = "embedded" | "openstack"``)."""
    if settings.cloud == "openstack" and settings.openstack is not None:
        from gpumode.cloud.openstack.factory import (
            platform_factory,  # the openstack extra, only when asked for
        )

        return platform_factory(settings.openstack)
    return EmbeddedPlatform


@dataclass
class ServerState:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    metrics: Metrics
    platform_factory: Callable[[Session], CloudPlatform] = EmbeddedPlatform
    # Agents' long polls waiting in this process, woken when their node gets work.
    wakeups: Wakeups = field(default_factory=Wakeups)
    # Last time each node reported, kept in memory: an unchanged report must not write to the database, and
    # liveness is a property of this process's view anyway (a restarted server waits for the next report).
    last_seen: dict[str, datetime] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The engine for the report's one read, outside a transaction: no BEGIN and ROLLBACK round trips.
    reader: Engine = field(init=False)
    # SQLite file: the report's read runs on the event loop with this engine (``db.make_inline_reader``).
    inline_reader: Engine | None = field(init=False)

    def __post_init__(self) -> None:
        self.reader = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self.inline_reader = db.make_inline_reader(self.engine)

    def close(self) -> None:
        """Release what this state opened itself (the engine belongs to whoever made it)."""
        if self.inline_reader is not None:
            self.inline_reader.dispose()

    def seen(self, node: str, when: datetime) -> None:
        with self.lock:
            self.last_seen[node] = when
