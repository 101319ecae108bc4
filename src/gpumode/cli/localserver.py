"""A real gpumode server on a free loopback port, in a thread of this process: the demo's control plane and
the remote CLI tests' server.

It is the same app ``gpumode server`` runs (uvicorn, SQLite, migrations at start); only the socket is ours,
bound before uvicorn starts, so the port is known up front and no other process can take it meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpumode.server.bootstrap import initialise
from gpumode.server.settings import Settings

if TYPE_CHECKING:
    import uvicorn


class LocalServerError(RuntimeError):
    """The server did not start (port, database); the message says why."""


@dataclass(frozen=True, slots=True)
class Credentials:
    admin_token: str
    join_token: str


class LocalServer:
    """Start with :meth:`start` (returns once it answers), stop with :meth:`stop`; also a context manager."""

    def __init__(
        self, db_path: Path, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise LocalServerError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        self.host, self.port = self._socket.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.settings = Settings(db=str(db_path), host=self.host, port=self.port, log_level=log_level)
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None

    def initialise(self, join_uses: int = 1) -> Credentials:
        """Create the schema, a fresh admin token and a join token good for ``join_uses`` joins
        (``gpumode server --init --join-uses N``)."""
        result = initialise(self.settings, join_uses=join_uses)
        return Credentials(result.admin_token, result.join_token)

    def start(self, timeout_s: float = 20.0) -> None:
        import uvicorn

        from gpumode.server.app import create_app

        config = uvicorn.Config(
            create_app(self.settings),
            log_level=self.settings.log_level,
            access_log=False,
            lifespan="on",
            # Agents' long polls hold requests open for up to a minute; stopping should not wait them out.
            timeout_graceful_shutdown=2,
        )
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [self._socket]}, name="gpumode-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise LocalServerError(f"the server on {self.url} did not start within {timeout_s:g} s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Ask uvicorn to finish (it drains requests in flight), then close the socket.

        Long polls still open after the grace period are cancelled; that is the expected end of a long
        poll here, so its traceback is not logged."""
        server = self._server
        if server is not None:
            server.should_exit = True
        if self._thread is not None:
            error_log = logging.getLogger("uvicorn.error")
            error_log.addFilter(_drop_cancelled)
            try:
                self._thread.join(timeout=10)
            finally:
                error_log.removeFilter(_drop_cancelled)
            self._thread = None
        self._socket.close()

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def quiet_server_logs() -> None:
    """uvicorn and the app log to stderr; the demo's narration should not be interleaved with them."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "gpumode.server"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _drop_cancelled(record: logging.LogRecord) -> bool:
    """Drop the cancelled long polls' tracebacks and uvicorn's note that it cancelled them."""
    if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
        return False
    return "graceful shutdown exceeded" not in record.getMessage()
