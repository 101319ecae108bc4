"""docs/deploy.md as the tests run it: its ``<!-- tested: NAME -->`` blocks, with the operator's paths, host
name and port swapped for a temporary directory and a free port — nothing else about them changes."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gpumode.tls import verify_context

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "deploy.md"
UNITS = REPO / "deploy" / "systemd"


def doc_block(name: str) -> str:
    """The fenced block after ``<!-- tested: name -->`` in docs/deploy.md."""
    found = re.search(rf"<!-- tested: {re.escape(name)} -->\n```\w*\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"docs/deploy.md has no block marked <!-- tested: {name} -->"
    return found.group(1)


def unit_command(unit: str, key: str = "ExecStart") -> str:
    for line in (UNITS / unit).read_text().splitlines():
        if line.startswith(f"{key}="):
            return line.split("=", 1)[1]
    raise AssertionError(f"{unit} has no {key}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Site:
    """One operator's machine, under ``root``: /opt/gpumode is ``prefix`` (a venv with gpumode in it),
    /etc/gpumode, /var/lib/gpumode and /var/backups are directories under ``root``."""

    root: Path
    prefix: Path
    port: int = field(default_factory=free_port)
    extra: dict[str, str] = field(default_factory=dict)
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    server: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        for part in ("etc/gpumode", "var/lib/gpumode", "var/backups"):
            (self.root / part).mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        return self.root / "etc/gpumode/tls/ca.pem"

    @property
    def db(self) -> Path:
        return self.root / "var/lib/gpumode/gpumode.db"

    def swap(self, text: str) -> str:
        """The doc's text for this site: longest names first, so ``DNS:gpumode.example`` wins over
        ``gpumode.example``."""
        table = {
            "/opt/gpumode": str(self.prefix),
            "/etc/gpumode": str(self.root / "etc/gpumode"),
            "/var/lib/gpumode": str(self.root / "var/lib/gpumode"),
            "/var/backups": str(self.root / "var/backups"),
            "DNS:gpumode.example": "IP:127.0.0.1",  # the test's clients connect to 127.0.0.1
            "gpumode.example:8443": f"127.0.0.1:{self.port}",
            'host = "0.0.0.0"': 'host = "127.0.0.1"',
            "port = 8443": f"port = {self.port}",
            "runuser -u gpumode -- ": "",  # the test is its own service user
            "-o gpumode -g gpumode ": "",
            **self.extra,
        }
        for old in sorted(table, key=len, reverse=True):
            text = text.replace(old, table[old])
        return text

    def run_block(self, name: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a shell block of the doc; ``systemctl`` only records what it was asked (the test starts and
        stops the server itself), into ``systemctl.log``."""
        log = self.root / "systemctl.log"
        script = f'systemctl() {{ echo "$*" >> {shlex.quote(str(log))}; }}\n' + self.swap(doc_block(name))
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env={**self.environ, **(env or {})},
            cwd=self.root,
        )
        assert result.returncode == 0, f"block {name} failed:\n{script}\n{result.stdout}\n{result.stderr}"
        return result

    def write_block(self, name: str, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.swap(doc_block(name)))
        return path

    def start_server(self) -> None:
        """The server unit's own ExecStart, on this site."""
        log = (self.root / "server.log").open("ab")
        self.server = subprocess.Popen(shlex.split(self.swap(unit_command("gpumode-server.service"))),
                                       stdout=log, stderr=log, env=self.environ)  # fmt: skip
        wait_for(self.healthy, 60, "the server to answer /healthz over TLS")

    def healthy(self) -> bool:
        assert self.server is not None
        if self.server.poll() is not None:
            raise AssertionError("the server exited:\n" + (self.root / "server.log").read_text()[-3000:])
        try:
            answer = httpx.get(f"{self.url}/healthz", verify=verify_context(self.ca), timeout=2)
            return answer.status_code == 200
        except httpx.TransportError:
            return False

    def stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            self.server.wait(30)
        self.server = None

    def api(self, method: str, path: str, token: str, **kw: object) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.request(method, f"{self.url}/api/v1{path}", headers=headers,  # type: ignore[arg-type]
                             verify=verify_context(self.ca), timeout=30, **kw)  # fmt: skip


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def admin_token(init_output: str) -> str:
    found = re.search(r"^\s+(gpmu_\S+)$", init_output, re.M)
    assert found, init_output
    return found.group(1)


def join_token(init_output: str) -> str:
    found = re.search(r"--token (gpmj_\S+)", init_output)
    assert found, init_output
    return found.group(1)
