"""Behind a reverse proxy (docs/deploy.md): X-Forwarded-For and X-Forwarded-Proto are believed from the
addresses in ``--forwarded-allow-ips`` only. The dashboard's sign-in, which needs HTTPS except from loopback,
shows which client and scheme the server believed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from .walkthrough import admin_token, free_port, wait_for

GPUMODE = [sys.executable, "-m", "gpumode"]


@pytest.fixture
def database(tmp_path: Path) -> tuple[Path, str]:
    db = tmp_path / "gpumode.db"
    init = subprocess.run([*GPUMODE, "server", "--init", "--db", str(db)], capture_output=True, text=True,
                          check=True, timeout=120)  # fmt: skip
    return db, admin_token(init.stdout)


@contextmanager
def _serve(db: Path, *extra: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([*GPUMODE, "server", "--db", str(db), "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, "the server exited"
        try:
            return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 60, "the server")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _sign_in(url: str, token: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/ui/login", data={"token": token}, headers=headers, timeout=30)


def test_forwarded_headers_are_ignored_unless_the_proxy_is_trusted(database: tuple[Path, str]) -> None:
    db, admin = database
    with _serve(db) as url:  # no trusted proxy: a client cannot claim another address or HTTPS
        spoofed = _sign_in(url, admin, **{"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https"})
        assert spoofed.status_code == 303  # still loopback, as the socket says
        assert "secure" not in spoofed.headers["set-cookie"].lower()  # and still plain HTTP


def test_a_trusted_proxy_passes_on_the_client_and_the_scheme(database: tuple[Path, str]) -> None:
    db, admin = database
    with _serve(db, "--forwarded-allow-ips", "127.0.0.1") as url:
        remote = _sign_in(url, admin, **{"X-Forwarded-For": "203.0.113.9"})
        assert remote.status_code == 403 and "sign-in needs HTTPS here" in remote.text
        proxied = _sign_in(url, admin, **{"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https"})
        assert proxied.status_code == 303
        assert "secure" in proxied.headers["set-cookie"].lower()  # the cookie follows the proxy's HTTPS
