"""A dashboard under test: the real app over SQLite with emulated hosts joined, and a signed-in client."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from databases import empty_database
from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures import get_fixture
from gpumode.host.discover import discover
from gpumode.server.app import create_app
from gpumode.server.bootstrap import initialise
from gpumode.server.settings import Settings

LOOPBACK = ("127.0.0.1", 40000)
HGX, L40S = "hgx-h100-01", "l40s-node-03"


@dataclass
class Dash:
    client: TestClient
    admin: str
    join: str
    tmp: Path

    def api(self, method: str, path: str, token: str | None = None, **kw: object) -> object:
        headers = {"Authorization": f"Bearer {token or self.admin}"}
        return self.client.request(method, f"/api/v1{path}", headers=headers, **kw)  # type: ignore[arg-type]

    def token(self, role: str, name: str) -> str:
        headers = {"Authorization": f"Bearer {self.admin}"}
        r = self.client.post("/api/v1/tokens", headers=headers, json={"name": name, "role": role})
        assert r.status_code == 201, r.text
        secret: str = r.json()["token"]
        return secret

    def join_fixture(self, fixture: str) -> str:
        snapshot = discover(create_host(get_fixture(fixture), self.tmp / fixture))
        r = self.client.post(
            "/api/v1/agents/join",
            headers={"Authorization": f"Bearer {self.join}"},
            json={"hostname": snapshot.hostname, "snapshot": snapshot.to_dict()},
        )
        assert r.status_code == 201, r.text
        return snapshot.hostname

    def sign_in(self, token: str) -> None:
        self.client.cookies.clear()
        r = self.client.post("/ui/login", data={"token": token}, follow_redirects=False)
        assert r.status_code == 303, r.text

    def csrf(self, path: str = "/ui/") -> str:
        found = re.search(r'name="csrf" value="([^"]+)"', self.client.get(path).text)
        assert found is not None, f"no CSRF token on {path}"
        return found.group(1)


@dataclass(frozen=True)
class Seed:
    """A database with the schema, an admin, a join token and two hosts joined: built once per run (the
    emulated hosts and the migrations are the slow part), copied for each test."""

    db: Path
    admin: str
    join: str


@pytest.fixture(scope="session")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Seed:
    where = tmp_path_factory.mktemp("web-seed")
    settings = Settings(db=str(where / "gpumode.db"))
    creds = initialise(settings, join_uses=1000)
    with TestClient(create_app(settings), client=LOOPBACK) as client:
        d = Dash(client, creds.admin_token, creds.join_token, where)
        d.join_fixture("hgx-h100")
        d.join_fixture("l40s-sriov")
    return Seed(where / "gpumode.db", creds.admin_token, creds.join_token)


@pytest.fixture
def dash(seed: Seed, tmp_path: Path) -> Iterator[Dash]:
    for part in seed.db.parent.glob(f"{seed.db.name}*"):  # the WAL too: it may hold the last commits
        shutil.copy(part, tmp_path / part.name)
    settings = Settings(db=str(tmp_path / "gpumode.db"))
    with TestClient(create_app(settings), client=LOOPBACK) as client:
        yield Dash(client, seed.admin, seed.join, tmp_path)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """A database without any schema: a SQLite file, or a private PostgreSQL schema dropped afterwards."""
    with empty_database(request.param, tmp_path, "gpumode_gpus") as engine:
        yield engine
