"""Fixtures: the real app over SQLite and over PostgreSQL (a private schema per run), with an admin token."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event

from databases import postgres_schema
from gpumode.server import db
from gpumode.server.app import create_app
from gpumode.server.auth import Role, create_user_token
from gpumode.server.models import Base
from gpumode.server.settings import Settings

from .builders import host


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh schema in the shared ``test`` database, dropped at the end of the run."""
    with postgres_schema("gpumode_test") as url:
        yield url


@pytest.fixture(scope="session", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "sqlite":
        return str(tmp_path_factory.mktemp("db") / "gpumode.db")
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture(scope="session")
def engine(db_url: str) -> Iterator[Engine]:
    engine = db.make_engine(db_url)
    db.upgrade(engine)
    yield engine
    engine.dispose()


class WriteCounter:
    """Counts INSERT/UPDATE/DELETE statements sent to the database."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def __call__(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().split(" ", 1)[0].upper() in {"INSERT", "UPDATE", "DELETE"}:
            self.writes.append(statement)

    def digests(self) -> list[str]:
        """The writes that only store a report body's digest (once per body not seen before)."""
        return [w for w in self.writes if w.startswith("UPDATE nodes SET report_digest=")]

    def changes(self) -> list[str]:
        """The writes that change what the database says about anything (all but :meth:`digests`)."""
        return [w for w in self.writes if w not in self.digests()]


@dataclass
class Api:
    """The app under test with a client and helpers to act as someone."""

    client: TestClient
    engine: Engine
    admin: str
    writes: WriteCounter

    def headers(self, token: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token else {}

    def get(self, path: str, token: str | None = None, **kw: Any) -> Any:
        return self.client.get(f"/api/v1{path}", headers=self.headers(token or self.admin), **kw)

    def call(self, method: str, path: str, token: str | None, **kw: Any) -> Any:
        return self.client.request(method, f"/api/v1{path}", headers=self.headers(token), **kw)

    def token(self, role: Role, name: str | None = None) -> str:
        r = self.call(
            "POST", "/tokens", self.admin, json={"name": name or f"{role.value}-user", "role": role.value}
        )
        assert r.status_code == 201, r.text
        secret: str = r.json()["token"]
        return secret

    def join_token(self, uses: int = 1) -> str:
        r = self.call("POST", "/join-tokens", self.admin, json={"name": "test", "uses": uses})
        assert r.status_code == 201, r.text
        secret: str = r.json()["token"]
        return secret

    def join(self, name: str, gpus: int = 2, snapshot: dict[str, Any] | None = None) -> str:
        snap = snapshot or host(name, gpus).to_dict()
        r = self.call("POST", "/agents/join", self.join_token(), json={"hostname": name, "snapshot": snap})
        assert r.status_code == 201, r.text
        secret: str = r.json()["token"]
        return secret

    def report(self, name: str, token: str, snapshot: dict[str, Any]) -> Any:
        return self.call("POST", f"/nodes/{name}/report", token, json=snapshot)

    def events(self, **params: Any) -> list[dict[str, Any]]:
        r = self.get("/events", params=params)
        assert r.status_code == 200, r.text
        events: list[dict[str, Any]] = r.json()
        return events

    def cards(self, **params: Any) -> list[dict[str, Any]]:
        r = self.get("/cards", params=params)
        assert r.status_code == 200, r.text
        cards: list[dict[str, Any]] = r.json()
        return cards


def _wipe(engine: Engine) -> None:
    with engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())


@pytest.fixture
def settings(db_url: str) -> Settings:
    return Settings(db=db_url, max_body_bytes=256 * 1024)


@pytest.fixture
def api(engine: Engine, settings: Settings) -> Iterator[Api]:
    _wipe(engine)
    with db.make_sessionmaker(engine).begin() as session:
        _, admin = create_user_token(session, "root", Role.ADMIN, created_by="test")
    writes = WriteCounter()
    event.listen(engine, "before_cursor_execute", writes)
    try:
        with TestClient(create_app(settings, engine=engine)) as client:
            yield Api(client=client, engine=engine, admin=admin, writes=writes)
    finally:
        event.remove(engine, "before_cursor_execute", writes)
