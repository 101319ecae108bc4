"""The VMs an agent reports beside its snapshot stay current with several server processes on one database,
and migration 0004 back-fills the digest they are compared by."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from fastapi.testclient import TestClient
from sqlalchemy import Engine, MetaData, Table, event, insert, select, text
from sqlalchemy.exc import OperationalError

from databases import empty_database
from gpumode.server import db
from gpumode.server.app import create_app
from gpumode.server.models import Node, vms_digest
from gpumode.server.settings import Settings

from .builders import host
from .conftest import Api, WriteCounter


def _vm(name: str) -> dict[str, Any]:
    devices = [{"kind": "pci", "id": "0000:1b:00.0"}]
    return {"name": name, "uuid": f"uuid-{name}", "running": True, "devices": devices}


def _stored_vms(engine: Engine, node: str) -> list[str]:
    with engine.connect() as conn:
        vms = conn.scalar(select(Node.vms).where(Node.name == node))
    return [vm["name"] for vm in vms or []]


def test_two_servers_alternating_reports_keep_the_vms_the_host_has(api: Api, settings: Settings) -> None:
    """Server A sees body X (VMs x); server B then stores body Y (VMs y); A gets X again: the host has x
    again, so the database must say x — A has seen X before, which is no reason to skip it."""
    token = api.join("n1")
    x = {**host("n1").to_dict(), "vms": [_vm("vm-x")]}
    y = {**host("n1").to_dict(), "vms": [_vm("vm-y")]}
    other_engine = db.make_engine(settings.db)
    other_writes = WriteCounter()
    event.listen(other_engine, "before_cursor_execute", other_writes)
    try:
        with TestClient(create_app(settings, engine=other_engine)) as other:
            for client, body, expected in [
                (api.client, x, ["vm-x"]),
                (other, y, ["vm-y"]),
                (api.client, x, ["vm-x"]),
                (other, y, ["vm-y"]),
                (other, x, ["vm-x"]),
                (api.client, y, ["vm-y"]),
            ]:
                r = client.post("/api/v1/nodes/n1/report", json=body, headers=api.headers(token))
                assert r.status_code == 200, r.text
                assert r.json()["changed"] is False  # the VMs are not hardware
                assert _stored_vms(api.engine, "n1") == expected

            # The same report again, to either server, seen before or not: nothing is written.
            api.writes.writes.clear()
            other_writes.writes.clear()
            for client in (api.client, other, api.client, other):
                r = client.post("/api/v1/nodes/n1/report", json=y, headers=api.headers(token))
                assert r.status_code == 200 and r.json()["changed"] is False
            assert api.writes.writes == [] and other_writes.writes == []
    finally:
        event.remove(other_engine, "before_cursor_execute", other_writes)
        other_engine.dispose()
    assert _stored_vms(api.engine, "n1") == ["vm-y"]


def test_report_without_vms_keeps_the_stored_ones(api: Api) -> None:
    """An agent that cannot read its hypervisor sends no ``vms``: the server keeps what it had."""
    token = api.join("n1")
    assert api.report("n1", token, {**host("n1").to_dict(), "vms": [_vm("vm-a")]}).status_code == 200
    api.writes.writes.clear()
    r = api.report("n1", token, host("n1").to_dict())
    assert r.status_code == 200 and r.json()["changed"] is False
    assert api.writes.changes() == []  # at most the new body's digest
    assert _stored_vms(api.engine, "n1") == ["vm-a"]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """A database without any schema: a SQLite file, or a private PostgreSQL schema dropped afterwards."""
    with empty_database(request.param, tmp_path, "gpumode_vms") as engine:
        yield engine


def test_migration_0004_back_fills_the_vms_digest(empty: Engine) -> None:
    config = db.alembic_config(empty)
    command.upgrade(config, "0003")
    now = datetime.now(UTC)
    with_vms = [_vm("vm-b"), _vm("vm-a")]
    with empty.begin() as conn:
        nodes = Table("nodes", MetaData(), autoload_with=conn)  # as revision 0003 has it
        conn.execute(
            insert(nodes),
            [
                {"name": name, "fingerprint": "sha256:" + "0" * 64, "snapshot": host(name).to_dict(),
                 "mode": "accel", "driver_state": "datacenter", "gpu_count": 2, "created_at": now,
                 "changed_at": now, "vms": vms}
                for name, vms in (("with-vms", with_vms), ("no-vms", None), ("empty-vms", []))
            ],
        )  # fmt: skip
    command.upgrade(config, "0004")
    with empty.connect() as conn:
        digests = dict(conn.execute(text("SELECT name, vms_digest FROM nodes")).all())
    # The digest the server computes for the same VMs, so a report of them after the upgrade writes nothing.
    assert digests == {"with-vms": vms_digest(with_vms), "no-vms": None, "empty-vms": vms_digest([])}
    assert digests["with-vms"] != digests["empty-vms"]
    command.downgrade(config, "0003")
    command.upgrade(config, "head")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the event-loop reader is SQLite's alone
def test_a_locked_sqlite_file_sends_the_unchanged_check_to_a_worker_thread(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On SQLite the unchanged check runs on the event loop with a reader that gives up quickly; when the file
    is locked it must fall back to the worker-thread path and still answer, not fail the report."""
    state = api.client.app.state.gpumode  # type: ignore[attr-defined]
    assert state.inline_reader is not None
    token = api.join("n-locked")
    body = host("n-locked").to_dict()
    assert api.report("n-locked", token, body).status_code == 200  # the body is now known to this process

    def locked() -> Any:
        raise OperationalError("SELECT 1", {}, Exception("database is locked"))

    monkeypatch.setattr(state.inline_reader, "connect", locked)
    api.writes.writes.clear()
    r = api.report("n-locked", token, body)
    assert r.status_code == 200, r.text
    assert r.json()["changed"] is False
    assert api.writes.writes == []
