"""Server time of every dashboard page with a large fleet in the database.

Seeds a SQLite database with ``--hosts`` nodes (default 10,000) by bulk inserts of the rows a join and
its reports would leave — snapshots cloned from the emulated fixtures (HGX H100 in accel, L40S in vGPU,
RTX workstation in passthrough), their cards, host groups, events and audit entries, a finished switch job
— then renders each page in process through the real app and prints the median and worst time per page.
Target: every page under 200 ms.

    .venv/bin/python bench/dashboard.py [--hosts 10000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import insert

from gpumode.cloud.base import cards_for_snapshot
from gpumode.cloud.embedded import CardRecord
from gpumode.domain import HostSnapshot
from gpumode.host.discover import discover
from gpumode.host.emulated.create import create_host
from gpumode.host.emulated.fixtures import get_fixture
from gpumode.server import db
from gpumode.server.app import create_app
from gpumode.server.bootstrap import initialise
from gpumode.server.models import AuditEntry, Event, HostGroup, Job, Node
from gpumode.server.settings import Settings

FIXTURES = ("hgx-h100", "l40s-sriov", "rtx-workstation")
TARGET_MS = 200.0
KINDS = ("hardware.added", "card.added", "gpu.mode_changed")


def templates(workdir: Path) -> list[dict[str, Any]]:
    return [discover(create_host(get_fixture(f), workdir / f)).to_dict() for f in FIXTURES]


def seed(settings: Settings, hosts: int, workdir: Path) -> str:
    """Fill the database; returns the name of a host that has a finished job."""
    shapes = templates(workdir)
    engine = db.make_engine(settings.db)
    db.upgrade(engine)
    now = datetime.now(UTC)
    with db.make_sessionmaker(engine)() as session:
        session.execute(insert(HostGroup), [{"name": f"group-{g:02d}", "created_at": now} for g in range(20)])
        group_ids = [g.id for g in session.query(HostGroup).order_by(HostGroup.id)]
        nodes, cards = [], []
        for i in range(hosts):
            shape = shapes[i % len(shapes)]
            name = f"gpu-{i:05d}"
            snap = {**shape, "hostname": name}
            mode = {0: "accel", 1: "vgpu", 2: "passthrough"}[i % len(shapes)]
            nodes.append({
                "name": name, "group_id": group_ids[i % len(group_ids)], "fingerprint": shape["fingerprint"],
                "snapshot": snap, "mode": mode, "driver_state": shape["driver_state"],
                "gpu_count": len(shape["gpus"]), "created_at": now, "changed_at": now - timedelta(seconds=i),
                "vms": [],
            })  # fmt: skip
            for spec in cards_for_snapshot(HostSnapshot.from_dict(snap)):
                cards.append({
                    "node": name, "kind": spec.kind.value, "gpu": spec.gpu, "device": spec.device,
                    "identity": spec.identity, "vgpu_type": spec.vgpu_type,
                    "status": "in_use" if i % 7 == 0 else "free", "holder": "vm-x" if i % 7 == 0 else None,
                    "created_at": now, "updated_at": now,
                })  # fmt: skip
        for start in range(0, len(nodes), 1000):
            session.execute(insert(Node), nodes[start : start + 1000])
        for start in range(0, len(cards), 5000):
            session.execute(insert(CardRecord), cards[start : start + 5000])
        events = [
            {"node": f"gpu-{i % hosts:05d}", "kind": KINDS[i % 3],
             "severity": "info", "target": f"0000:{i % 256:02x}:00.0", "message": f"synthetic event {i}",
             "before": None, "after": None, "created_at": now - timedelta(seconds=i)}
            for i in range(50_000)
        ]  # fmt: skip
        session.execute(insert(Event), events)
        audit = [
            {"actor": f"user-{i % 13}", "role": "operator", "action": "PUT /api/v1/profiles/{name}",
             "target": f"profile:p{i}", "status_code": 200, "detail": f"synthetic {i}",
             "created_at": now - timedelta(seconds=i)}
            for i in range(20_000)
        ]  # fmt: skip
        session.execute(insert(AuditEntry), audit)
        node = session.query(Node).filter(Node.name == "gpu-00000").one()
        at = now.isoformat()
        steps = [{"id": f"{n:02d}-step", "action": "module.load", "target": "nvidia", "where": "host",
                  "description": "a step", "state": "done", "started_at": at,
                  "finished_at": at, "error": None, "note": None} for n in range(40)]  # fmt: skip
        session.execute(insert(Job), [{
            "node_id": node.id, "node": node.name, "state": "succeeded", "host_state": "done",
            "request": {"mode": "accel", "gpus": [], "vm_policy": "gpu"}, "plan": {"steps": []},
            "steps": steps,
            "cancel_requested": False, "error": None, "rollout_id": None, "created_by": "bench",
            "created_at": now, "started_at": now, "finished_at": now, "updated_at": now,
        }])  # fmt: skip
        session.commit()
    engine.dispose()
    return "gpu-00000"


def measure(client: TestClient, method: str, path: str, repeat: int, **kw: Any) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        r = client.request(method, path, **kw)
        times.append((time.perf_counter() - start) * 1000)
        if r.status_code >= 400:
            raise SystemExit(f"{method} {path}: {r.status_code} {r.text[:300]}")
    return statistics.median(times), max(times)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpumode-bench-dash-") as tmp:
        workdir = Path(tmp)
        settings = Settings(db=str(workdir / "gpumode.db"))
        creds = initialise(settings)
        started = time.perf_counter()
        host = seed(settings, args.hosts, workdir)
        print(f"seeded {args.hosts} hosts in {time.perf_counter() - started:.1f} s")
        with TestClient(create_app(settings), client=("127.0.0.1", 50000)) as client:
            client.post("/ui/login", data={"token": creds.admin_token})
            form = client.get(f"/ui/nodes/{host}/switch").text
            csrf = re.search(r'name="csrf" value="([^"]+)"', form)
            assert csrf is not None
            last_page = -(-args.hosts // 50)
            pages: list[tuple[str, str, str, dict[str, Any]]] = [
                ("fleet, page 1", "GET", "/ui/", {}),
                ("fleet, last page", "GET", f"/ui/?page={last_page}", {}),
                ("fleet, mode=vgpu", "GET", "/ui/?mode=vgpu", {}),
                ("fleet, model=10de:2330", "GET", "/ui/?model=10de:2330", {}),
                ("fleet, group", "GET", "/ui/?group=group-07", {}),
                ("host", "GET", f"/ui/nodes/{host}", {}),
                ("switch form", "GET", f"/ui/nodes/{host}/switch", {}),
                ("switch preview", "POST", f"/ui/nodes/{host}/switch/preview",
                 {"data": {"csrf": csrf.group(1), "mode": "passthrough", "vm_policy": "all"}}),
                ("job", "GET", "/ui/jobs/1", {}),
                ("events", "GET", "/ui/events", {}),
                ("events, search", "GET", "/ui/events?q=event+4999", {}),
                ("audit", "GET", "/ui/audit", {}),
                ("audit, search", "GET", "/ui/audit?q=p1999", {}),
                ("whitelist & profiles", "GET", "/ui/whitelist", {}),
            ]  # fmt: skip
            print(f"{'page':<26}{'median ms':>10}{'max ms':>10}")
            worst = 0.0
            for label, method, path, kw in pages:
                median, top = measure(client, method, path, args.repeat, **kw)
                worst = max(worst, median)
                flag = "" if median < TARGET_MS else "  over target"
                print(f"{label:<26}{median:>10.1f}{top:>10.1f}{flag}")
    print(f"target: every page's median < {TARGET_MS:.0f} ms — {'met' if worst < TARGET_MS else 'NOT met'}")
    return 0 if worst < TARGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
