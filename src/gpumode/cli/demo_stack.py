"""What ``gpumode demo`` runs: a server on SQLite, emulated hosts, and one real agent per host.

Everything lives in one directory (``gpumode.db``, ``hosts/<fixture>/``, ``logs/``), so ``--dir`` keeps a demo
to look at afterwards. The agents are ``gpumode agent`` processes, started exactly as the server's join
command says (plus ``--root``, since their hosts are emulated): the demo exercises the product, not a
stand-in for it. Each agent's output goes to ``logs/agent-<host>.log``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from gpumode.cli.localserver import Credentials, LocalServer
from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures import get_fixture
from gpumode.host.root import Host

DEFAULT_FIXTURES = ("hgx-h100", "l40s-sriov", "rtx-workstation")
AGENT_INTERVAL_S = 10.0  # report at least this often (liveness)
AGENT_CHECK_S = 0.5  # look for changes this often: a pulled GPU shows up at once


class DemoError(RuntimeError):
    """The demo could not set itself up (directory, server, an agent died); the message says what."""


@dataclass
class DemoHost:
    fixture: str
    hostname: str
    host: Host


@dataclass
class DemoStack:
    directory: Path
    port: int = 0
    hosts: dict[str, DemoHost] = field(default_factory=dict)
    server: LocalServer | None = None
    credentials: Credentials | None = None
    _agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _logs: list[IO[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    @property
    def admin_token(self) -> str:
        assert self.credentials is not None
        return self.credentials.admin_token

    def start_server(self) -> None:
        """Start the server in a fresh directory: a demo tells one story from the start, so a used
        directory is refused rather than half reused."""
        if self.directory.exists() and (not self.directory.is_dir() or any(self.directory.iterdir())):
            raise DemoError(f"{self.directory} is not an empty directory; give a new or empty one to --dir")
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "logs").mkdir(exist_ok=True)
        self.server = LocalServer(self.directory / "gpumode.db", port=self.port)
        self.credentials = self.server.initialise(join_uses=len(DEFAULT_FIXTURES))
        self.server.start()

    def create_host(self, fixture: str) -> DemoHost:
        """Create the fixture's emulated host under ``hosts/<fixture>``."""
        spec = get_fixture(fixture)
        demo_host = DemoHost(fixture, spec.hostname, create_host(spec, self.directory / "hosts" / fixture))
        self.hosts[spec.hostname] = demo_host
        return demo_host

    def start_agent(self, hostname: str) -> None:
        """Start ``gpumode agent`` for a host with the join token; it joins, reports, and runs its jobs."""
        assert self.credentials is not None
        demo_host = self.hosts[hostname]
        log = (self.directory / "logs" / f"agent-{hostname}.log").open("ab")
        self._logs.append(log)
        argv = [
            *_gpumode_argv(),
            "agent",
            "--server", self.url,
            "--token", self.credentials.join_token,
            "--root", str(demo_host.host.root),
            "--interval", f"{AGENT_INTERVAL_S:g}",
            "--check", f"{AGENT_CHECK_S:g}",
        ]  # fmt: skip
        # A session of its own: Ctrl-C reaches the demo only, which then stops the agents in order.
        self._agents[hostname] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def check_agents(self) -> None:
        """Raise if an agent process has exited (its log says why)."""
        for hostname, proc in self._agents.items():
            if proc.poll() is not None:
                raise DemoError(
                    f"the agent of {hostname} exited with status {proc.returncode}; "
                    f"see {self.directory / 'logs' / f'agent-{hostname}.log'}"
                )

    def stop(self) -> None:
        """Stop the agents (SIGTERM, then SIGKILL after a grace period), then the server."""
        for proc in self._agents.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self._agents.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._agents.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self.server is not None:
            self.server.stop()
            self.server = None


def _gpumode_argv() -> list[str]:
    """How to run this very gpumode: the console script beside this interpreter, else through Python."""
    script = Path(sys.executable).with_name("gpumode")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", "from gpumode.cli.main import main; main()"]
