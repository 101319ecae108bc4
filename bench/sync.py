"""Benchmark hardware sync: 10,000 synthetic hosts reporting to one uvicorn server on loopback.

For each database (SQLite file, PostgreSQL in a throw-away schema) the fleet is seeded with bulk inserts, a
server is started the way ``gpumode server`` starts it, and a load generator (``bench/loadgen.py``, a lean
HTTP/1.1 client in a process of its own) posts each host's report — its snapshot and four VMs:

- ``first pass``: every host once, back to back (closed loop), right after the server started: what a
  restart costs, when this process has not yet seen any host's report body;
- ``unchanged``: the snapshot the server already has (the steady state: nothing may be written), in an
  **open loop** at ``--rate`` reports/s (default 333: 10,000 hosts, one report each every 30 s): requests go
  out on schedule whether or not earlier ones returned, and latency counts from the scheduled send time, so
  queueing in the server cannot hide behind a slowed-down client;
- ``changed``: each report flips its host between two hardware layouts (one GPU's subsystem id changes), so
  every report diffs, replaces a card, records events and stores the snapshot; open loop at
  ``--changed-rate``.

``--closed`` runs the two scenarios closed-loop instead (``--concurrency`` clients back to back): the most the
server can take. Printed side by side per database: offered and achieved rate, latency percentiles, errors,
the server's CPU per report (its own process's CPU time, whatever else runs on the machine), the generator's
CPU, and whether the target — 333 reports/s with p99 < 50 ms for unchanged snapshots — is met. The load
average is printed so readers can judge how quiet the machine was.

    .venv/bin/python bench/sync.py                          # 10,000 hosts x 8 GPUs, both databases
    .venv/bin/python bench/sync.py --closed                 # saturation: maximum reports/s
    .venv/bin/python bench/sync.py --hosts 1000 --backends sqlite --seconds 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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
from gpumode.server.models import ApiToken, Node, vms_digest

PG_BASE = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TARGET_RPS, TARGET_P99_MS = 333.0, 50.0
LOADGEN = Path(__file__).with_name("loadgen.py")
CLOSED_MAX_RATE = 5000.0  # reports/s no closed-loop run on 2 cores comes near; only sizes the job list


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


def vms(name: str, gpus: int) -> list[dict[str, Any]]:
    """Four running VMs sharing the host's GPUs, as an agent reports them beside its snapshot."""
    addresses = [f"0000:{0x18 + i * 0x10:02x}:00.0" for i in range(gpus)]
    return [
        {
            "name": f"{name}-vm{k}",
            "uuid": f"00000000-0000-4000-8000-{k:012d}",
            "running": True,
            "devices": [{"kind": "pci", "id": a} for a in addresses[k::4]],
        }
        for k in range(4)
    ]


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
    # The schema's name is also the connections' application_name: their backends' CPU is counted by it.
    url = f"{PG_BASE}?options=-csearch_path%3D{schema}&application_name={schema}"
    return Backend("postgresql", url, [schema])


def database_cpu(backend: Backend) -> dict[int, float]:
    """CPU seconds of each PostgreSQL backend serving the server (by application_name); a backend that exits
    during a run takes its share with it, so this is a lower bound. Empty for SQLite (in the server)."""
    if not backend.cleanup:
        return {}
    admin = create_engine(PG_BASE)
    try:
        with admin.connect() as conn:
            query = text("SELECT pid FROM pg_stat_activity WHERE application_name = :name")
            pids = conn.scalars(query, {"name": backend.cleanup[0]}).all()
    finally:
        admin.dispose()
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            found[pid] = cpu_seconds(pid)
    return found


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
                    "vms": vms(s.hostname, gpus),
                    "vms_digest": vms_digest(vms(s.hostname, gpus)),
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

# As ``gpumode server`` runs it: uvicorn's defaults pick uvloop and httptools when installed.
SERVER = """
import sys, uvicorn
from gpumode.server.app import create_app
from gpumode.server.settings import Settings
uvicorn.run(create_app(Settings(db=sys.argv[1])), host="127.0.0.1", port=int(sys.argv[2]),
            log_level="warning", access_log=False)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(url: str, profile: list[str] | None) -> tuple[subprocess.Popen[bytes], int, int]:
    """The server process, its port, and the pid whose CPU to count (the server's, also under a profiler)."""
    port = free_port()
    command = [sys.executable, "-c", SERVER, url, str(port)]
    proc = subprocess.Popen([*(profile or []), *command])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc, port, _server_pid(proc.pid) if profile else proc.pid
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.terminate()
    raise RuntimeError("server did not come up within 60 s")


def _server_pid(parent: int) -> int:
    """The Python child a profiler started."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return int(children[0]) if children else parent


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process: the server's cost per report, whatever else shares the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    mode: str  # "open" or "closed"
    offered: float | None  # reports/s asked for (open loop)
    sent: int
    latencies_ms: list[float]
    failures: list[str]
    timeouts: int
    seconds: float
    generator_cpu_s: float
    late_ms: list[float] = field(default_factory=list)
    server_cpu_s: float = 0.0
    database_cpu_s: float | None = None  # PostgreSQL's backends; None for SQLite

    @property
    def done(self) -> int:
        return len(self.latencies_ms)

    @property
    def errors(self) -> int:
        return len(self.failures) + self.timeouts

    @property
    def achieved(self) -> float:
        return (self.done - len(self.failures)) / self.seconds if self.seconds else 0.0

    def per_report_ms(self, cpu_s: float) -> float:
        return cpu_s * 1000 / self.done if self.done else 0.0

    def pct(self, p: float, values: list[float] | None = None) -> float:
        data = self.latencies_ms if values is None else values
        if len(data) < 2:
            return data[0] if data else 0.0
        return statistics.quantiles(data, n=1000, method="inclusive")[round(p * 10) - 1]

    def meets_target(self) -> bool:
        """The target is for a fleet's steady rate, so only an open-loop run at >= 333/s can meet it."""
        return (
            self.mode == "open"
            and (self.offered or 0) >= TARGET_RPS
            and self.achieved >= TARGET_RPS * 0.98  # the schedule's own ramp and drain cost a little
            and self.errors == 0
            and self.pct(99) < TARGET_P99_MS
        )


def generate(port: int, spec: dict[str, Any], pid: int, backend: Backend, workdir: Path) -> Result:
    """Run the load generator in its own process and read its result; the server's and the database's CPU
    are taken around it."""
    jobs_file, result_file = workdir / "jobs.pickle", workdir / "result.json"
    with jobs_file.open("wb") as f:
        pickle.dump({"host": "127.0.0.1", "port": port, **spec}, f)
    db_before = database_cpu(backend)
    before = cpu_seconds(pid)
    subprocess.run([sys.executable, str(LOADGEN), str(jobs_file), str(result_file)], check=True)
    server_cpu = cpu_seconds(pid) - before
    db_after = database_cpu(backend)
    db_cpu = sum(cpu - db_before.get(p, 0.0) for p, cpu in db_after.items()) if backend.cleanup else None
    got = json.loads(result_file.read_text())
    return Result(
        mode=spec["mode"],
        offered=spec.get("rate"),
        sent=got["sent"],
        latencies_ms=got["latencies_ms"],
        failures=got["failures"],
        timeouts=got["timeouts"],
        seconds=got["seconds"],
        generator_cpu_s=got["generator_cpu_s"],
        late_ms=got["late_ms"],
        server_cpu_s=server_cpu,
        database_cpu_s=db_cpu,
    )


def request(name: str, token: str, body: bytes) -> bytes:
    head = (
        f"POST /api/v1/nodes/{name}/report HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def bodies(names: list[str], gpus: int, variant: int) -> dict[str, bytes]:
    """Report bodies as an agent sends them: the snapshot's JSON with the host's VMs beside it."""
    template = snapshot("template", gpus, variant=variant).to_dict()
    out = {}
    for name in names:
        snap = HostSnapshot.from_dict({**template, "hostname": name})
        snap.fingerprint = snap.compute_fingerprint()
        out[name] = json.dumps({**snap.to_dict(), "vms": vms(name, gpus)}).encode()
    return out


UNCHANGED, CHANGED = b'"changed":false', b'"changed":true'


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
        order = sorted(tokens)
        random.Random(7).shuffle(order)  # hosts report in a fixed random order, each at most once per cycle
        same = bodies(order, args.gpus, variant=0)
        profile = None
        if args.py_spy:
            out = Path(args.profile_dir) / f"{name}.txt"
            options = ["--nonblocking", "--gil", "--format", "raw", "--rate", "100", "-o", str(out)]
            profile = [args.py_spy, "record", *options, "--"]
        proc, port, pid = start_server(backend.url, profile)
        results: dict[str, Result] = {}
        try:
            # Every host once: the server process sees each body for the first time.
            plain = {n: request(n, tokens[n], same[n]) for n in order}  # shared: pickled once each
            first = [(plain[n], UNCHANGED) for n in order]
            results["first pass"] = generate(
                port, {"mode": "closed", "jobs": first, "conns": 8, "seconds": 600}, pid, backend, workdir
            )
            steady = [(plain[n], UNCHANGED) for n in _cycle(order, _count(args, args.rate))]
            results["unchanged"] = generate(port, _spec(args, steady, args.rate), pid, backend, workdir)
            # Changed: each host flips 0 -> 1 -> 0 ...; one cycle through the fleet apart.
            flipped = bodies(order, args.gpus, variant=1)
            other = {n: request(n, tokens[n], flipped[n]) for n in order}
            state: dict[str, int] = {}
            changed = []
            for n in _cycle(order, _count(args, args.changed_rate)):
                state[n] = 1 - state.get(n, 0)
                changed.append((other[n] if state[n] else plain[n], CHANGED))
            results["changed"] = generate(
                port, _spec(args, changed, args.changed_rate), pid, backend, workdir
            )
        finally:
            # Under a profiler, stop the server itself: the profiler then writes what it saw and exits.
            os.kill(pid, signal.SIGTERM)
            proc.wait(30)
        return results
    finally:
        drop_backend(backend)


def _count(args: argparse.Namespace, rate: float) -> int:
    """Reports to prepare: the schedule's in an open loop; in a closed one more than it can send in time."""
    count: float = (CLOSED_MAX_RATE if args.closed else rate) * args.seconds
    return max(1, round(count))


def _cycle(order: list[str], count: int) -> list[str]:
    return [order[i % len(order)] for i in range(count)]


def _spec(args: argparse.Namespace, jobs: list[tuple[bytes, bytes]], rate: float) -> dict[str, Any]:
    if args.closed:
        return {"mode": "closed", "jobs": jobs, "conns": args.concurrency, "seconds": args.seconds}
    # Enough connections that a slow answer never makes a later request wait for one (HTTP/1.1: one each).
    return {"mode": "open", "jobs": jobs, "rate": rate, "conns": 512, "warm_conns": 64, "drain": 30.0}


def report(results: dict[str, dict[str, Result]], args: argparse.Namespace, loads: list[str]) -> bool:
    columns = [(b, s) for b in results for s in ("unchanged", "changed")]
    print()
    print(f"cores: {os.cpu_count()}; load average (1/5/15 min) " + "; ".join(loads))
    print(f"{'':26}" + "".join(f"{b + ' ' + s:>22}" for b, s in columns))
    rows: tuple[tuple[str, Callable[[Result], str]], ...] = (
        ("loop", lambda r: "open" if r.mode == "open" else f"closed x{args.concurrency}"),
        ("offered reports/s", lambda r: f"{r.offered:.0f}" if r.mode == "open" else "max"),
        ("achieved reports/s", lambda r: f"{r.achieved:.0f}"),
        ("reports (errors)", lambda r: f"{r.done} ({r.errors})"),
        ("p50 ms", lambda r: f"{r.pct(50):.1f}"),
        ("p90 ms", lambda r: f"{r.pct(90):.1f}"),
        ("p99 ms", lambda r: f"{r.pct(99):.1f}"),
        ("max ms", lambda r: f"{max(r.latencies_ms, default=0):.1f}"),
        ("server CPU ms/report", lambda r: f"{r.per_report_ms(r.server_cpu_s):.2f}"),
        (
            "postgres CPU ms/report >=",  # backends that exit during a run take theirs along
            lambda r: "-" if r.database_cpu_s is None else f"{r.per_report_ms(r.database_cpu_s):.2f}",
        ),
        ("generator CPU ms/report", lambda r: f"{r.per_report_ms(r.generator_cpu_s):.2f}"),
        ("generator late p99 ms", lambda r: f"{r.pct(99, r.late_ms):.1f}" if r.late_ms else "-"),
    )
    for label, value in rows:
        print(f"{label:26}" + "".join(f"{value(results[b][s]):>22}" for b, s in columns))
    print()
    ok = True
    for b, per in results.items():
        first = per["first pass"]
        cpu = first.per_report_ms(first.server_cpu_s)
        print(
            f"{b}: first pass after start ({first.done} hosts, closed x8): {first.achieved:.0f} reports/s, "
            f"p99 {first.pct(99):.1f} ms, server CPU {cpu:.2f} ms/report, {first.errors} errors"
        )
    for b, per in results.items():
        r = per["unchanged"]
        target = (
            f"{b}: unchanged target ({TARGET_RPS:.0f}/s open loop, p99 < {TARGET_P99_MS:.0f} ms, no errors)"
        )
        if args.closed:
            print(f"{target}: not measured by a closed loop (run without --closed)")
            continue
        met = r.meets_target()
        ok = ok and met
        print(f"{target}: {'met' if met else 'NOT met'}")
        for scenario, res in per.items():
            for failure in sorted(set(res.failures))[:3]:
                print(f"  {scenario} error: {failure}")
    return ok


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, default=10_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--rate", type=float, default=TARGET_RPS, help="unchanged reports/s (open loop)")
    parser.add_argument("--changed-rate", type=float, default=50.0, help="changed reports/s (open loop)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each scenario")
    parser.add_argument("--closed", action="store_true", help="closed loop: maximum throughput")
    parser.add_argument("--concurrency", type=int, default=16, help="clients in closed-loop runs")
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--py-spy", help="profile the server with this py-spy binary (slows it down)")
    parser.add_argument("--profile-dir", default=".", help="where py-spy writes <backend>.txt")
    args = parser.parse_args()
    print(f"command: {' '.join(sys.argv)}", file=sys.stderr)
    results: dict[str, dict[str, Result]] = {}
    loads = []
    with tempfile.TemporaryDirectory(prefix="gpumode-bench-") as tmp:
        for name in args.backends.split(","):
            loads.append(f"{name.strip()} start {loadavg()}")
            got = run_backend(name.strip(), args, Path(tmp))
            if got is not None:
                results[name.strip()] = got
    loads.append(f"end {loadavg()}")
    if not results:
        return 2
    return 0 if report(results, args, loads) else 1


if __name__ == "__main__":
    sys.exit(main())
