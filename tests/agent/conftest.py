"""End-to-end fixtures: a real ``gpumode server`` subprocess on a loopback port (SQLite or PostgreSQL) and
``gpumode agent`` subprocesses on emulated hosts; both can be killed and started again."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from databases import postgres_schema
from gpumode.emulated.spec import HostSpec
from gpumode.host.root import Host
from gpumode.server import db
from gpumode.server.auth import Role, create_user_token
from host_templates import emulated_host

GPUMODE = [sys.executable, "-c", "from gpumode.cli.main import app; app()"]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield str(tmp_path / "gpumode.db")
        return
    with postgres_schema("gpumode_agent") as url:
        yield url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Server:
    """``gpumode server`` in a child process; ``kill`` (SIGKILL) and ``start`` again on the same port."""

    db: str
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    admin: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*GPUMODE, "server", "--db", self.db, "--port", str(self.port)], stdout=out, stderr=out
            )
        wait_for(self._healthy, 30, "the server to answer /healthz")

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited: {self.log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def call(self, method: str, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token or self.admin}"}
        return httpx.request(method, f"{self.url}/api/v1{path}", headers=headers, timeout=30, **kw)

    def get(self, path: str, token: str | None = None, **kw: Any) -> Any:
        r = self.call("GET", path, token, **kw)
        assert r.status_code == 200, r.text
        return r.json()

    def join_token(self) -> str:
        r = self.call("POST", "/join-tokens", json={"name": "e2e", "uses": 1000})
        assert r.status_code == 201, r.text
        token: str = r.json()["token"]
        return token

    def job(self, job_id: int) -> dict[str, Any]:
        body: dict[str, Any] = self.get(f"/jobs/{job_id}")
        return body

    def wait_job(self, job_id: int, states: set[str], timeout: float = 60) -> dict[str, Any]:
        def ended() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if job["state"] in states else None

        result: dict[str, Any] = wait_for(ended, timeout, f"job {job_id} to be {states}")
        return result


@pytest.fixture
def server(db_url: str, tmp_path: Path) -> Iterator[Server]:
    engine = db.make_engine(db_url)
    db.upgrade(engine)
    with db.make_sessionmaker(engine).begin() as session:
        _, admin = create_user_token(session, "root", Role.ADMIN, created_by="test")
    engine.dispose()
    srv = Server(db=db_url, log=tmp_path / "server.log", admin=admin)
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


@dataclass
class Agent:
    """``gpumode agent`` for one emulated host, in a child process."""

    server: Server
    host: Host
    token: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None, options: Sequence[str] = ()) -> None:
        """Start the agent; ``options`` go on its command line (``--no-desired``)."""
        argv = [
            *GPUMODE, "agent", "--server", self.server.url, "--token", self.token,
            "--root", str(self.host.root), "--check", "0.3", "--wait", "2", "--max-backoff", "0.5",
            "--interval", "30", *options,
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out, env={**os.environ, **(env or {})})

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def output(self) -> str:
        return self.log.read_text()


@pytest.fixture
def agents(server: Server, tmp_path: Path) -> Iterator[Callable[[Host], Agent]]:
    started: list[Agent] = []
    token = server.join_token()

    def make(host: Host) -> Agent:
        agent = Agent(server, host, token, tmp_path / f"agent-{len(started)}.log")
        started.append(agent)
        return agent

    yield make
    for agent in started:
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(10)


def emulated(fixture: str | HostSpec, directory: Path, key: str | None = None) -> Host:
    """A fresh emulated host: a copy of one built once per test session (``tests/host_templates.py``)."""
    return emulated_host(fixture, directory, key)
