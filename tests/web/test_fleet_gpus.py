"""The fleet's GPUs in SQL (``node_gpus``) on SQLite and PostgreSQL: kept by the sync, back-filled by
migration 0005, and what the fleet page's model filter and GPU totals read — a GPU that offers no card
included."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, MetaData, Table, insert, select

from gpumode.cloud.embedded import EmbeddedPlatform
from gpumode.domain import HostSnapshot, Mode
from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures import get_fixture
from gpumode.host.discover import discover
from gpumode.server import db, gpu_index, sync
from gpumode.server.models import Node, NodeGpu
from gpumode.server.web import queries


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, HostSnapshot]:
    """An H100 host in accel (cards) and a T4 host in mode ``none`` (no cards)."""
    where = tmp_path_factory.mktemp("hosts")
    return {f: discover(create_host(get_fixture(f), where / f)) for f in ("hgx-h100", "t4-mdev")}


def _stored(engine: Engine) -> dict[str, list[dict[str, object]]]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(Node.name, NodeGpu.address, NodeGpu.model, NodeGpu.name, NodeGpu.mode, NodeGpu.driver)
            .join(Node, Node.id == NodeGpu.node_id)
            .order_by(Node.name, NodeGpu.address)
        ).all()
    found: dict[str, list[dict[str, object]]] = {}
    for node, address, model, name, mode, driver in rows:
        found.setdefault(node, []).append(
            {"address": address, "model": model, "name": name, "mode": mode, "driver": driver}
        )
    return found


def test_migration_0005_back_fills_every_stored_snapshot(
    empty: Engine, hosts: dict[str, HostSnapshot]
) -> None:
    config = db.alembic_config(empty)
    before = ScriptDirectory.from_config(config).get_revision("0005").down_revision
    assert isinstance(before, str)
    command.upgrade(config, before)
    now = datetime.now(UTC)
    with empty.begin() as conn:
        nodes = Table("nodes", MetaData(), autoload_with=conn)  # as that revision has it
        conn.execute(
            insert(nodes),
            [
                {"name": s.hostname, "fingerprint": s.fingerprint, "snapshot": s.to_dict(), "mode": "none",
                 "driver_state": s.driver_state.value, "gpu_count": len(s.gpus), "created_at": now,
                 "changed_at": now}
                for s in hosts.values()
            ],
        )  # fmt: skip
    command.upgrade(config, "0005")
    expected = {s.hostname: sorted(gpu_index.gpu_rows(s), key=lambda r: r["address"]) for s in hosts.values()}
    assert _stored(empty) == expected
    assert {r["model"] for r in expected[hosts["t4-mdev"].hostname]} == {"10de:1eb8"}
    command.downgrade(config, before)
    command.upgrade(config, "head")
    assert _stored(empty) == expected


def test_sync_keeps_the_gpus_and_the_fleet_counts_every_gpu(
    empty: Engine, hosts: dict[str, HostSnapshot]
) -> None:
    db.upgrade(empty)
    sessions = db.make_sessionmaker(empty)
    now = datetime.now(UTC)
    with sessions.begin() as session:
        for snapshot in hosts.values():
            sync.apply_snapshot(session, EmbeddedPlatform(session), snapshot, now=now)
    h100, t4 = hosts["hgx-h100"], hosts["t4-mdev"]
    assert _stored(empty)[t4.hostname] == gpu_index.gpu_rows(t4)
    with sessions() as session:
        platform = EmbeddedPlatform(session)
        fleet = queries.fleet_page(session, platform, queries.FleetFilter(), {})
        by_t4 = queries.fleet_page(session, platform, queries.FleetFilter(model="10de:1eb8"), {})
        cards = platform.list_cards()
    assert [r.name for r in by_t4.rows] == [t4.hostname] and by_t4.matching == 1
    assert by_t4.rows[0].gpus == [(g.address, "none") for g in t4.gpus]
    assert fleet.gpus_by_mode == {"accel": len(h100.gpus), "vgpu": 0, "passthrough": 0, "none": len(t4.gpus)}
    assert [m for m, _ in fleet.models] == ["10de:1eb8", "10de:2330"]
    assert fleet.cards_by_status["free"] == len(cards) == len(h100.gpus)  # the T4s offer no card
    per_host = {r.name: sum(r.cards.values()) for r in fleet.rows}
    assert per_host == {h100.hostname: len(h100.gpus), t4.hostname: 0}

    # A changed report rewrites the rows of the node it changed, in its transaction.
    moved = HostSnapshot.from_dict(t4.to_dict())
    moved.gpus[0].mode, moved.gpus[0].driver = Mode.PASSTHROUGH, "vfio-pci"
    with sessions.begin() as session:
        node = session.scalars(select(Node).where(Node.name == t4.hostname)).one()
        sync.apply_snapshot(session, EmbeddedPlatform(session), moved, now=now, node=node)
    assert [r["mode"] for r in _stored(empty)[t4.hostname]] == ["passthrough"] + ["none"] * (len(t4.gpus) - 1)
    with sessions() as session:
        fleet = queries.fleet_page(session, EmbeddedPlatform(session), queries.FleetFilter(), {})
    assert (fleet.gpus_by_mode["passthrough"], fleet.gpus_by_mode["none"]) == (1, len(t4.gpus) - 1)
