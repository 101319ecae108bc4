"""Benchmark hardware sync: many synthetic hosts reporting to one uvicorn server on loopback.

For each database (SQLite file, PostgreSQL in a throw-away schema) the fleet is seeded in-process through the
same sync code the server runs, a server is started, and a load generator posts snapshots:

- ``unchanged``: the snapshot the server already has (the steady state: nothing may be written);
- ``changed``: each report flips its host between two hardware layouts (one GPU's subsystem id changes), so
  every report diffs, replaces a card, records events and stores the snapshot.

Runs are bounded by a request count and a time limit per scenario. Results are printed side by side: reports/s
and p50/p99 latency. The target is 333 reports/s with p99 < 50 ms for unchanged snapshots (10,000 hosts, one
report each every 30 s).

    .venv/bin/python bench/sync.py                       # 10,000 hosts x 8 GPUs, both databases
    .venv/bin/python bench/sync.py --hosts 1000 --backends sqlite --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
from sqlalchemy import create_engine, insert, text

from gpumode.cloud.base import cards_for_snapshot
from gpumode.cloud.embedded import EmbeddedPlatform
from gpumode.domain import (
    NVIDIA_VENDOR,
    DriverState,
    Flavour,
    Gpu,
    HostSnapshot,
    Mode,
    NvidiaDriver,
    PciFunction,
)
from gpumode.server import db, sync
from gpumode.server.auth import Role, TokenKind, new_secret
from gpumode.server.models import ApiToken, Node

PG_BASE = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TARGET_RPS, TARGET_P99_MS = 333.0, 50.0


def snapshot(name: str, gpus: int, *, variant: int = 0) -> HostSnapshot:
    """An accel host with ``gpus`` H100s, one IOMMU group each; variant 1 swaps GPU 0's board."""
    functions, gpu_list = [], []
    for i in range(gpus):
        address = f"0000:{0x18 + i * 0x10:02x}:00.0"
        subsys = 0x16C1 if (i or not variant) else 0x16C2
        functions.append(
            PciFunction(
                address=address,
                vendor=NVIDIA_VENDOR,
                device=0x2330,
                subsystem_vendor=NVIDIA_VENDOR,
                subsystem_device=subsys,
                class_code=0x030200,
                revision=0xA1,
                numa_node=i // 4,
                iommu_group=20 + i,
                driver="nvidia",
                device_name="GH100 [H100 SXM5 80GB]",
            )
        )
        gpu_list.append(
            Gpu(
                address=address,
                device=0x2330,
                name="H100 SXM5 80GB",
                numa_node=i // 4,
                iommu_group=20 + i,
                driver="nvidia",
                mode=Mode.ACCEL,
            )
        )
    snap = HostSnapshot(
        hostname=name,
        kernel="6.8.0-45-generic",
        functions=functions,
        gpus=gpu_list,
        nvswitches=[],
        modules=[],
        nvidia=NvidiaDriver(loaded=True, flavour=Flavour.DATACENTER, version="550.90.07"),
        driver_state=DriverState.DATACENTER,
    )
    snap.fingerprint = snap.compute_fingerprint()
    return snap


def host_name(i: int) -> str:
    return f"gpu-{i:05d}"


# --- databases ----------------------------------------------------------------------------------------------


@dataclass
class Backend:
    name: str
    url: str
    cleanup: list[str]


def make_backend(name: str, workdir: Path) -> Backend | None:
    if name == "sqlite":
        return Backend("sqlite", str(workdir / "bench.db"), [])
    schema = f"gpumode_bench_{secrets.token_hex(4)}"
    try:
        admin = create_engine(PG_BASE, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        admin.dispose()
    except Exception as exc:  # no PostgreSQL here: report it, bench the rest
        print(f"postgresql: skipped ({exc.__class__.__name__}: {str(exc).splitlines()[0]})", file=sys.stderr)
        return None
    return Backend("postgresql", f"{PG_BASE}?options=-csearch_path%3D{schema}", [schema])


def drop_backend(backend: Backend) -> None:
    if backend.cleanup:
        admin = create_engine(PG_BASE, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            for schema in backend.cleanup:
                conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def seed(url: str, hosts: int, gpus: int, batch: int = 1000) -> dict[str, str]:
    """Create the fleet with bulk inserts of exactly the rows a join would leave (node, node token, cards);
    joining 10,000 hosts one by one would take longer than the benchmark itself. Returns the node tokens."""
    engine = db.make_engine(url)
    db.upgrade(engine)
    sessions = db.make_sessionmaker(engine)
    template = snapshot("template", gpus).to_dict()
    tokens: dict[str, str] = {}
    now = datetime.now(UTC)
    for start in range(0, hosts, batch):
        snaps = []
        for i in range(start, min(hosts, start + batch)):
            snap = HostSnapshot.from_dict({**template, "hostname": host_name(i)})
            snap.fingerprint = snap.compute_fingerprint()
            snaps.append(snap)
        with sessions.begin() as session:
            node_rows = [
                {
                    "name": s.hostname,
                    "fingerprint": s.fingerprint,
                    "snapshot": s.to_dict(),
                    "mode": sync.host_mode(s),
                    "driver_state": s.driver_state.value,
                    "gpu_count": len(s.gpus),
                    "created_at": now,
                    "changed_at": now,
                }
                for s in snaps
            ]
            ids = dict(session.execute(insert(Node).returning(Node.name, Node.id), node_rows).all())
            token_rows = []
            for s in snaps:
                secret, digest = new_secret(TokenKind.NODE)
                tokens[s.hostname] = secret
                token_rows.append(
                    {
                        "name": f"node:{s.hostname}",
                        "role": Role.NODE.value,
                        "token_hash": digest,
                        "node_id": ids[s.hostname],
                        "revoked": False,
                        "created_at": now,
                        "created_by": "bench",
                    }
                )
            session.execute(insert(ApiToken), token_rows)
            EmbeddedPlatform(session).register_cards([c for s in snaps for c in cards_for_snapshot(s)])
    engine.dispose()
    return tokens


# --- server and load ----------------------------------------------------------------------------------------

SERVER = """
import sys, uvicorn
from gpumode.server.app import create_app
from gpumode.server.settings import Settings
uvicorn.run(create_app(Settings(db=sys.argv[1], db_pool_size=20)), host="127.0.0.1", port=int(sys.argv[2]),
            log_level="warning", access_log=False)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, url, str(port)])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.terminate()
    raise RuntimeError("server did not come up within 30 s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process: the server's cost per report, whatever else shares the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    requests: int
    errors: int
    seconds: float
    latencies_ms: list[float]
    server_cpu_s: float = 0.0

    @property
    def cpu_ms_per_report(self) -> float:
        return self.server_cpu_s * 1000 / self.requests if self.requests else 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def pct(self, p: float) -> float:
        if len(self.latencies_ms) < 2:
            return self.latencies_ms[0] if self.latencies_ms else 0.0
        return statistics.quantiles(self.latencies_ms, n=100, method="inclusive")[int(p) - 1]


async def load(
    base: str, jobs: list[tuple[str, str, bytes]], concurrency: int, seconds: float, expect_changed: bool
) -> Result:
    """Post each job (host, token, body) once, ``concurrency`` at a time, until done or out of time.

    Jobs of one host are never in flight together (each worker owns the hosts it is given), so every "changed"
    report really changes the stored snapshot.
    """
    latencies: list[float] = []
    errors = 0
    lanes: list[list[tuple[str, str, bytes]]] = [[] for _ in range(concurrency)]
    for job in jobs:
        lanes[hash(job[0]) % concurrency].append(job)
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:

        async def worker(lane: list[tuple[str, str, bytes]]) -> None:
            nonlocal errors
            for name, token, body in lane:
                if time.monotonic() > deadline:
                    return
                started = time.perf_counter()
                r = await client.post(
                    f"/api/v1/nodes/{name}/report",
                    content=body,
                    headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                )
                latencies.append((time.perf_counter() - started) * 1000)
                if r.status_code != 200 or r.json()["changed"] is not expect_changed:
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(lane) for lane in lanes))
        elapsed = time.perf_counter() - started
    return Result(len(latencies), errors, elapsed, latencies)


def bodies(names: list[str], gpus: int, variant: int) -> dict[str, bytes]:
    template = snapshot("template", gpus, variant=variant).to_dict()
    out = {}
    for name in names:
        snap = HostSnapshot.from_dict({**template, "hostname": name})
        snap.fingerprint = snap.compute_fingerprint()
        out[name] = json.dumps(snap.to_dict()).encode()
    return out


def run_backend(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Result] | None:
    backend = make_backend(name, workdir)
    if backend is None:
        return None
    try:
        t0 = time.perf_counter()
        tokens = seed(backend.url, args.hosts, args.gpus)
        print(
            f"{name}: seeded {args.hosts} hosts x {args.gpus} GPUs in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        proc, base = start_server(backend.url)
        try:
            names = sorted(tokens)
            rng = random.Random(7)
            sample = [rng.choice(names) for _ in range(args.requests)]
            same = bodies(sorted(set(sample)), args.gpus, variant=0)
            cpu = cpu_seconds(proc.pid)
            unchanged = await_run(base, [(n, tokens[n], same[n]) for n in sample], args, expect_changed=False)
            unchanged.server_cpu_s, cpu = cpu_seconds(proc.pid) - cpu, cpu_seconds(proc.pid)
            # Changed: each host flips 0 -> 1 -> 0 ...; a host appears at most a few times in the sample.
            flip = bodies(sorted(set(sample)), args.gpus, variant=1)
            state: dict[str, int] = {}
            jobs = []
            for n in sample:
                state[n] = 1 - state.get(n, 0)
                jobs.append((n, tokens[n], flip[n] if state[n] else same[n]))
            changed = await_run(base, jobs, args, expect_changed=True)
            changed.server_cpu_s = cpu_seconds(proc.pid) - cpu
        finally:
            proc.terminate()
            proc.wait(10)
        return {"unchanged": unchanged, "changed": changed}
    finally:
        drop_backend(backend)


def await_run(
    base: str, jobs: list[tuple[str, str, bytes]], args: argparse.Namespace, *, expect_changed: bool
) -> Result:
    return asyncio.run(load(base, jobs, args.concurrency, args.seconds, expect_changed))


def report(results: dict[str, dict[str, Result]]) -> bool:
    names = list(results)
    print()
    print(f"{'':24}" + "".join(f"{n:>22}" for n in names))
    ok = True
    for scenario in ("unchanged", "changed"):
        rows: tuple[tuple[str, Callable[[Result], str]], ...] = (
            ("reports", lambda r: f"{r.requests} ({r.errors} bad)"),
            ("reports/s", lambda r: f"{r.rps:.0f}"),
            ("p50 ms", lambda r: f"{r.pct(50):.1f}"),
            ("p99 ms", lambda r: f"{r.pct(99):.1f}"),
            ("server CPU ms/report", lambda r: f"{r.cpu_ms_per_report:.2f}"),
        )
        for label, value in rows:
            print(
                f"{scenario + ' ' + label:24}" + "".join(f"{value(results[n][scenario]):>22}" for n in names)
            )
        print()
    for n in names:
        r = results[n]["unchanged"]
        met = r.rps >= TARGET_RPS and r.pct(99) < TARGET_P99_MS and r.errors == 0
        ok = ok and met
        print(
            f"{n}: unchanged target ({TARGET_RPS:.0f}/s, p99 < {TARGET_P99_MS:.0f} ms): "
            f"{'met' if met else 'NOT met'}"
        )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, default=10_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--requests", type=int, default=3000, help="reports per scenario")
    parser.add_argument("--seconds", type=float, default=20.0, help="time limit per scenario")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--backends", default="sqlite,postgresql")
    args = parser.parse_args()
    results: dict[str, dict[str, Result]] = {}
    with tempfile.TemporaryDirectory(prefix="gpumode-bench-") as tmp:
        for name in args.backends.split(","):
            got = run_backend(name.strip(), args, Path(tmp))
            if got is not None:
                results[name.strip()] = got
    if not results:
        return 2
    return 0 if report(results) else 1


if __name__ == "__main__":
    sys.exit(main())
