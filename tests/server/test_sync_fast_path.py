"""The report route's fast path (stored digest, one parse, stored forms diffed, only changed rows written)
leaves the database exactly as the plain path does: each snapshot rebuilt from its JSON, fingerprinted from
its objects, and folded in by :func:`gpumode.server.sync.apply_snapshot` with nothing handed to it."""

from __future__ import annotations

import copy
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from gpumode.cloud.base import CardStatus
from gpumode.cloud.embedded import CardRecord, EmbeddedPlatform
from gpumode.domain import HostSnapshot, Mode
from gpumode.server import card_holders, db, sync
from gpumode.server.app import create_app
from gpumode.server.models import Event, Node, NodeGpu
from gpumode.server.settings import Settings

from .builders import host, with_vendor_vgpu
from .conftest import Api

NODES = ("fast-a", "fast-b", "fast-c")
REPORTS = 40  # per node


def _vm(name: str, devices: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "uuid": f"00000000-0000-4000-8000-{sum(map(ord, name)):012d}",
        "running": True,
        "devices": [{"kind": "pci", "id": d} for d in devices],
    }


def _random_body(rng: random.Random, name: str) -> dict[str, Any]:
    """A host of 4 GPUs with what changes on real hosts varied at random: a GPU switched to passthrough, a
    GPU lost, a board swapped (other subsystem id), a vGPU on a VF, the VMs."""
    snap = host(name, 4)
    for gpu in list(snap.gpus):
        fn = snap.function(gpu.address)
        assert fn is not None
        roll = rng.random()
        if roll < 0.2:  # switched to passthrough
            gpu.mode, gpu.driver, fn.driver = Mode.PASSTHROUGH, "vfio-pci", "vfio-pci"
        elif roll < 0.3:  # fell off the bus
            snap.gpus.remove(gpu)
            snap.functions.remove(fn)
        elif roll < 0.4:  # another board in the slot
            fn.subsystem_device = 0x16C2
        elif roll < 0.5:  # no driver
            gpu.mode, gpu.driver, fn.driver = Mode.NONE, None, None
    if snap.gpus and rng.random() < 0.3:
        gpu = snap.gpus[0]
        gpu.mode = Mode.VGPU
        with_vendor_vgpu(snap, gpu.address, gpu.address[:-1] + "4", type_id=rng.choice([1147, 1148]))
    snap.fingerprint = snap.compute_fingerprint()
    gpus = [g.address for g in snap.gpus]
    vms = [_vm(f"{name}-vm{k}", gpus[k::2]) for k in range(rng.randrange(0, 3))]
    body = snap.to_dict()
    if rng.random() < 0.8:  # sometimes the agent cannot read its hypervisor
        body["vms"] = vms
    return body


def _plain_report(session: Session, name: str, body: dict[str, Any], now: datetime) -> None:
    """The plain path: objects from JSON, the fingerprint from the objects, the sync given nothing else; the
    cards follow the VMs whenever the VMs or the hardware changed."""
    body = copy.deepcopy(body)
    vms = body.pop("vms", None)
    snapshot = HostSnapshot.from_dict(body)
    snapshot.fingerprint = snapshot.compute_fingerprint()
    node = session.scalars(select(Node).where(Node.name == name)).one()
    platform = EmbeddedPlatform(session)
    changed = vms is not None and node.vms != vms
    if changed:
        node.vms = vms
    if node.fingerprint != snapshot.fingerprint:
        sync.apply_snapshot(session, platform, snapshot, now=now, node=node)
        changed = True
    if changed:
        session.add_all(card_holders.follow_vms(platform, name, node.vms, now))
    session.commit()


def _hold_one_card(session: Session, name: str) -> None:
    """Someone holds the node's first card, so losing its device keeps it as ``lost`` (an alarm)."""
    platform = EmbeddedPlatform(session)
    first = platform.list_cards(node=name)[0]
    platform.update_card(first.id, status=CardStatus.IN_USE, holder=f"{name}-tenant")
    session.commit()


def _contents(engine: Engine) -> dict[str, Any]:
    """Everything the sync writes, without ids and times (the two databases number and date differently)."""
    with Session(engine) as session:
        nodes = {
            n.name: (n.fingerprint, n.snapshot, n.mode, n.driver_state, n.gpu_count, n.vms, n.vms_digest)
            for n in session.scalars(select(Node))
        }
        names = dict(session.execute(select(Node.id, Node.name)).all())
        gpus = sorted(
            (names[g.node_id], g.address, g.model, g.name, g.mode, g.driver)
            for g in session.scalars(select(NodeGpu))
        )
        cards = sorted(
            (c.node, c.kind, c.gpu, c.device, c.identity, c.vgpu_type, c.status, c.holder)
            for c in session.scalars(select(CardRecord))
        )
        events = [
            (e.node, e.kind, e.severity, e.target, _without_card_ids(e.message), e.before, e.after)
            for e in session.scalars(select(Event).order_by(Event.id))
        ]
        for e in events:
            for side in (e[5], e[6]):
                if isinstance(side, dict):
                    side.pop("id", None)
    return {"nodes": nodes, "gpus": gpus, "cards": cards, "events": events}


def _without_card_ids(message: str) -> str:
    words = message.split()
    return " ".join("#" if i and words[i - 1] == "card" and w.isdigit() else w for i, w in enumerate(words))


def test_random_changed_reports_leave_the_database_as_the_plain_path_does(
    api: Api, settings: Settings, tmp_path: Path
) -> None:
    rng = random.Random(17)
    plain = db.make_engine(str(tmp_path / "plain.db"))
    db.upgrade(plain)
    now = datetime.now(UTC)
    tokens = {}
    first = {name: host(name, 4).to_dict() for name in NODES}
    with Session(plain) as session:
        for name in NODES:
            tokens[name] = api.join(name, snapshot=first[name])
            sync.apply_snapshot(session, EmbeddedPlatform(session), host(name, 4), now=now)
            session.commit()
            _hold_one_card(session, name)
    with Session(api.engine) as session:
        for name in NODES:
            _hold_one_card(session, name)

    other = TestClient(create_app(settings))  # a second server process on the same database
    with other:
        clients = (api.client, other)
        sent = 0
        for _ in range(REPORTS):
            for name in NODES:
                body = _random_body(rng, name)
                # Now and then the same body again, to the same or the other process: answered from its
                # digest, it must change nothing.
                for _repeat in range(rng.choice([1, 1, 2])):
                    client = rng.choice(clients)
                    path = f"/api/v1/nodes/{name}/report"
                    r = client.post(path, json=body, headers=api.headers(tokens[name]))
                    assert r.status_code == 200, r.text
                    sent += 1
                with Session(plain) as session:
                    _plain_report(session, name, body, now)
    fast, reference = _contents(api.engine), _contents(plain)
    plain.dispose()
    assert sent > REPORTS * len(NODES)
    assert len(reference["events"]) > 100  # the reports did change things: cards, modes, hardware, alarms
    assert {e[1] for e in reference["events"]} >= {
        "hardware.removed",
        "hardware.added",
        "hardware.changed",
        "gpu.mode_changed",
        "card.removed",
        "card.added",
        "alarm.card_lost",
    }
    assert fast["nodes"] == reference["nodes"]
    assert fast["gpus"] == reference["gpus"]
    assert fast["cards"] == reference["cards"]
    assert fast["events"] == reference["events"]
