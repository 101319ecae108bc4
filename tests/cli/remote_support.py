"""A real server on loopback with two emulated hosts joined, and a way to run the CLI against it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from gpumode.agent import config as agent_config
from gpumode.cli.localserver import LocalServer
from gpumode.cli.main import app
from gpumode.emulated.create import create_host
from gpumode.host.discover import discover
from gpumode.host.root import Host

# Every variable the client reads, unset unless a test sets it, so the caller's shell cannot leak in.
CLEAN_ENV = {"GPUMODE_SERVER": None, "GPUMODE_TOKEN": None, "GPUMODE_CLIENT_CONFIG": None}


@dataclass
class Fleet:
    server: LocalServer
    admin: str
    join: str
    home: Path
    hosts: dict[str, Host] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url

    def api(self, method: str, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token or self.admin}"}
        return httpx.request(method, f"{self.url}/api/v1{path}", headers=headers, timeout=30, **kw)

    def cli(
        self, *args: str, token: str | None = "admin", env: dict[str, str | None] | None = None
    ) -> Result:
        """Run ``gpumode ARGS`` in-process; by default as admin through the environment, HOME isolated."""
        environ: dict[str, str | None] = {**CLEAN_ENV, "HOME": str(self.home), "GPUMODE_SERVER": self.url}
        if token is not None:
            environ["GPUMODE_TOKEN"] = self.admin if token == "admin" else self.tokens.get(token, token)
        environ.update(env or {})
        return CliRunner().invoke(app, list(args), env=environ, catch_exceptions=False)

    def join_host(self, fixture: str, directory: Path) -> Host:
        host = create_host(fixture, directory)
        snapshot = discover(host)
        r = httpx.post(
            f"{self.url}/api/v1/agents/join",
            headers={"Authorization": f"Bearer {self.join}"},
            json={"hostname": snapshot.hostname, "snapshot": snapshot.to_dict()},
            timeout=30,
        )
        assert r.status_code == 201, r.text
        # the node token where the agent keeps it: an agent started on this host later re-joins with it as
        # proof that it is this node (a join token alone may not take over an existing node)
        agent_config.save(host, agent_config.AgentConfig(self.url, r.json()["node"], r.json()["token"]))
        self.hosts[snapshot.hostname] = host
        return host


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("fleet")
    server = LocalServer(base / "gpumode.db")
    creds = server.initialise(join_uses=1000)
    server.start()
    home = base / "home"
    home.mkdir()
    fleet = Fleet(server, creds.admin_token, creds.join_token, home)
    try:
        fleet.join_host("rtx-workstation", base / "ws")  # ws-cad-12: 1 GPU in passthrough
        fleet.join_host("t4-mdev", base / "t4")  # t4-edge-02: 4 T4s, no driver
        for role in ("viewer", "operator"):
            r = fleet.api("POST", "/tokens", json={"name": f"{role}-test", "role": role})
            assert r.status_code == 201, r.text
            fleet.tokens[role] = r.json()["token"]
        yield fleet
    finally:
        server.stop()


@pytest.fixture
def t4_agent(fleet: Fleet, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``gpumode agent`` for the T4 host: it rejoins with the join token and takes the node's jobs."""
    gpumode = Path(sys.executable).with_name("gpumode")
    host = fleet.hosts["t4-edge-02"]
    log = (tmp_path / "agent.log").open("wb")
    argv = [str(gpumode), "agent", "--server", fleet.url, "--token", fleet.join, "--root", str(host.root),
            "--check", "0.5", "--no-desired"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
