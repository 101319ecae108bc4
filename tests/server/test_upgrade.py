"""Upgrades: ``gpumode server migrate`` takes a database made by the previous release (schema 0005) with data
in it to this release's schema, refuses a schema newer than it knows, and the server refuses to start on an
unmigrated database, naming the command."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text
from typer.testing import CliRunner

from databases import empty_database
from gpumode.cli.main import app as cli
from gpumode.server import db
from gpumode.server.app import create_app
from gpumode.server.auth import hash_secret
from gpumode.server.settings import Settings

from .builders import host

PREVIOUS_RELEASE = "0005"  # the newest revision of gpumode 0.1.0
ADMIN = "gpmu_previous-release-admin-token"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def old(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Engine, str]]:
    """A database at the previous release's schema, filled through plain SQL of that schema (the models
    describe the newest one): a group, a node with its snapshot and GPU rows, a card, an admin token."""
    with empty_database(request.param, tmp_path, "gpumode_upgrade") as engine:
        command.upgrade(db.alembic_config(engine), PREVIOUS_RELEASE)
        now = datetime(2026, 6, 1, tzinfo=UTC)
        snapshot = host("old-node", gpus=2).to_dict()
        with engine.begin() as conn:
            group = "INSERT INTO host_groups (id, name, created_at) VALUES (1, 'rack-a', :t)"
            conn.execute(text(group), {"t": now})
            conn.execute(
                text(
                    "INSERT INTO nodes (id, name, group_id, fingerprint, snapshot, mode, driver_state, "
                    "gpu_count, created_at, changed_at) VALUES (1, 'old-node', 1, :fp, :snap, 'accel', "
                    "'accel', 2, :t, :t)"
                ),
                {"fp": snapshot["fingerprint"], "snap": json.dumps(snapshot), "t": now},
            )
            for i, gpu in enumerate(snapshot["gpus"]):
                conn.execute(
                    text(
                        "INSERT INTO node_gpus (node_id, address, model, name, mode, driver) "
                        "VALUES (1, :a, '10de:2330', 'H100', 'accel', 'nvidia')"
                    ),
                    {"a": gpu["address"]},
                )
                if i == 0:
                    conn.execute(
                        text(
                            "INSERT INTO cards (node, kind, gpu, device, identity, status, created_at, "
                            "updated_at) VALUES ('old-node', 'accel', :a, :a, :i, 'free', :t, :t)"
                        ),
                        {"a": gpu["address"], "i": f"old-node/{gpu['address']}", "t": now},
                    )
            conn.execute(
                text(
                    "INSERT INTO api_tokens (name, role, token_hash, revoked, created_at) "
                    "VALUES ('admin', 'admin', :h, false, :t)"
                ),
                {"h": hash_secret(ADMIN), "t": now},
            )
        yield engine, engine.url.render_as_string(hide_password=False)


def test_migrate_upgrades_the_previous_release_with_its_data(old: tuple[Engine, str]) -> None:
    engine, url = old
    assert db.current_revision(engine) == PREVIOUS_RELEASE
    result = CliRunner().invoke(cli, ["server", "migrate", "--db", url])
    assert result.exit_code == 0, result.output
    head = db.head_revision()
    assert db.current_revision(engine) == head
    expected = "is up to date" if head == PREVIOUS_RELEASE else f"from revision {PREVIOUS_RELEASE} to {head}"
    assert expected in result.output
    # the server starts on it, and the previous release's token, node, group and card are all there
    with TestClient(create_app(Settings(db=url), engine=engine)) as client:
        auth = {"Authorization": f"Bearer {ADMIN}"}
        nodes = client.get("/api/v1/nodes", headers=auth)
        assert nodes.status_code == 200, nodes.text
        assert [n["name"] for n in nodes.json()] == ["old-node"]
        detail = client.get("/api/v1/nodes/old-node", headers=auth).json()
        assert len(detail["gpus"]) == 2
        groups = client.get("/api/v1/groups", headers=auth).json()
        assert [(g["name"], g["nodes"]) for g in groups] == [("rack-a", ["old-node"])]
        cards = client.get("/api/v1/cards", headers=auth).json()
        assert [(c["node"], c["status"]) for c in cards] == [("old-node", "free")]
    again = CliRunner().invoke(cli, ["server", "migrate", "--db", url])
    assert again.exit_code == 0 and "is up to date" in again.output


def test_server_refuses_an_unmigrated_database_naming_the_command(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    engine = db.make_engine(str(path))
    command.upgrade(db.alembic_config(engine), "0004")
    with pytest.raises(db.SchemaError, match=r"at revision 0004.*run `gpumode server migrate`"):
        db.check_schema(engine)
    engine.dispose()
    result = CliRunner().invoke(cli, ["server", "--db", str(path), "--port", "1"])
    assert result.exit_code == 2
    assert "gpumode server migrate" in result.output
    missing = tmp_path / "new.db"
    empty = CliRunner().invoke(cli, ["server", "--db", str(missing), "--port", "1"])
    assert empty.exit_code == 2
    assert "no database at" in empty.output and "gpumode server --init" in empty.output
    assert not missing.exists()  # a refusal creates nothing


def test_migrate_refuses_a_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "newer.db"
    engine = db.make_engine(str(path))
    db.upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    result = CliRunner().invoke(cli, ["server", "migrate", "--db", str(path)])
    assert result.exit_code == 2
    assert "revision 9999, newer than this gpumode knows" in result.output
    with engine.connect() as conn:  # nothing changed
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "9999"
    with pytest.raises(db.SchemaError, match="newer than this gpumode knows"):
        db.check_schema(engine)
    engine.dispose()
