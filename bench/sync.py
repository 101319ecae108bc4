"""Benchmark hardware sync: a fleet of hosts reporting to a uvicorn server on loopback, side by side.

Two kinds of report bodies (``--bodies``, default both):

- ``real``: what real agents send, made by the emulated fixtures (``bench/bodies.py``): all five host shapes
  (HGX H100 with 180 PCI functions, A16 VDI, L40S SR-IOV, T4 mdev, a workstation), varied per host (PCI bus
  numbers, VMs, vGPUs); a changed report is a real change of that host — a VM stopped or started, a vGPU
  created, a GPU switched to vfio-pci, a GPU lost — made by the same host code a switch uses;
- ``synthetic``: an accel host with ``--gpus`` H100s; a changed report swaps GPU 0's board (subsystem id).

For each database (SQLite file, PostgreSQL in a throw-away schema) and each kind the fleet is seeded with bulk
inserts, a server is started the way ``gpumode server`` starts it, and a load generator (``bench/loadgen.py``,
a lean HTTP/1.1 client in a process of its own) posts each host's report:

- ``first pass, new bodies``: every host once, back to back (closed loop), with bodies the server has not
  stored a digest of (an agent upgrade, or a server that keeps nothing): every body is parsed;
- ``first pass``: the server restarted, every host once again: what a restart costs;
- ``unchanged``: the body the server already has (the steady state: nothing may be written), in an **open
  loop** at ``--rate`` reports/s (default 333: 10,000 hosts, one report each every 30 s): requests go out on
  schedule whether or not earlier ones returned, and latency counts from the scheduled send time, so queueing
  in the server cannot hide behind a slowed-down client;
- ``changed``: each report flips its host between its two states, so every report diffs, records events,
  reconciles cards and stores the snapshot (or, for a VM change, the VMs); open loop at ``--changed-rate``;
- on PostgreSQL, ``--processes`` (default 1,2,4): the server started as ``gpumode server --workers N`` and
  changed reports sent closed-loop (``--concurrency`` clients): reports/s in all, per process, server CPU
  (all its processes) and the database's own CPU per report.

``--closed`` runs unchanged and changed closed-loop instead: the most the server can take. Printed side by
side: offered and achieved rate, latency percentiles, errors, the server's CPU per report (its own processes'
CPU time, whatever else runs on the machine), PostgreSQL's CPU per report, the generator's CPU, the server's
memory, and whether the target — 333 reports/s with p99 < 50 ms for unchanged snapshots — is met. Load
averages are printed so readers can judge how quiet the machine was. Run it with another tree first on
``PYTHONPATH`` to measure that tree's server side by side ("before").

    .venv/bin/python bench/sync.py                          # 2,000 hosts, real and synthetic, both databases
    .venv/bin/python bench/sync.py --closed                 # saturation: maximum reports/s
    .venv/bin/python bench/sync.py --hosts 1000 --backends sqlite --bodies real --seconds 5
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
        return Backend("sqlite", str(workdir / f"bench-{secrets.token_hex(4)}.db"), [])
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


@dataclass
class Fleet:
    """The hosts of one run: each host's token once seeded, and its two report bodies."""

    kind: str  # "real" or "synthetic"
    order: list[str]  # hosts in the fixed random order they report in
    base: dict[str, bytes]  # what the server is seeded with; the unchanged report
    changed: dict[str, bytes]  # the host after its change
    shapes: dict[str, str] = field(default_factory=dict)  # host -> "fixture/change" (real bodies)
    tokens: dict[str, str] = field(default_factory=dict)


def synthetic_fleet(names: list[str], gpus: int) -> Fleet:
    return Fleet("synthetic", names, bodies(names, gpus, variant=0), bodies(names, gpus, variant=1))


def real_fleet(names: list[str], cache: Path) -> Fleet:
    sys.path.insert(0, str(Path(__file__).parent))
    import bodies as agent_bodies  # bench/bodies.py, beside this script

    shapes = agent_bodies.cached_shapes(cache)
    hosts = agent_bodies.fleet(names, shapes)
    return Fleet(
        "real",
        names,
        {n: h.base for n, h in hosts.items()},
        {n: h.changed for n, h in hosts.items()},
        {n: f"{h.fixture}/{h.change}" for n, h in hosts.items()},
    )


def seed(url: str, fleet: Fleet, batch: int = 500) -> None:
    """Create the fleet with bulk inserts of exactly the rows a join and its first report would leave (node
    with its snapshot and VMs, node token, cards); joining thousands of hosts one by one would take longer
    than the benchmark itself. No report digest is stored: the first pass is the bodies' first parse."""
    engine = db.make_engine(url)
    db.upgrade(engine)
    sessions = db.make_sessionmaker(engine)
    now = datetime.now(UTC)
    for start in range(0, len(fleet.order), batch):
        snaps, reported_vms = [], {}
        for name in fleet.order[start : start + batch]:
            data = json.loads(fleet.base[name])
            reported_vms[name] = data.pop("vms", None)
            snaps.append(HostSnapshot.from_dict(data))
        with sessions.begin() as session:
            node_rows = [
                {
                    "name": s.hostname,
                    "fingerprint": s.fingerprint,
                    "snapshot": s.to_dict(),
                    "mode": sync.host_mode(s),
                    "driver_state": s.driver_state.value,
                    "gpu_count": len(s.gpus),
                    "vms": reported_vms[s.hostname],
                    "vms_digest": vms_digest(reported_vms[s.hostname]),
                    "created_at": now,
                    "changed_at": now,
                }
                for s in snaps
            ]
            ids = dict(session.execute(insert(Node).returning(Node.name, Node.id), node_rows).all())
            token_rows = []
            for s in snaps:
                secret, digest = new_secret(TokenKind.NODE)
                fleet.tokens[s.hostname] = secret
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


# --- server and load ----------------------------------------------------------------------------------------

# As ``gpumode server`` runs it: uvicorn's defaults pick uvloop and httptools when installed. With more than
# one process, as ``gpumode server --workers N`` runs them: uvicorn's supervisor, one shared socket, each
# worker building its app from the same settings (the factory is written beside the database, so that a
# tree without ``--workers`` can be measured the same way).
SERVER = """
import os, sys, uvicorn
from gpumode.server.settings import Settings
settings, port, processes = Settings(db=sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
options = dict(host="127.0.0.1", port=port, log_level="warning", access_log=False)
if processes == 1:
    from gpumode.server.app import create_app
    uvicorn.run(create_app(settings), **options)
else:
    os.environ["GPUMODE_BENCH_SETTINGS"] = settings.model_dump_json()
    sys.path.insert(0, sys.argv[4])
    uvicorn.run("gpumode_bench_app:app", factory=True, workers=processes, **options)
"""
FACTORY = """
import os
from gpumode.server.app import create_app
from gpumode.server.settings import Settings

def app():
    return create_app(Settings.model_validate_json(os.environ["GPUMODE_BENCH_SETTINGS"]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(
    url: str, profile: list[str] | None, workdir: Path, processes: int = 1
) -> tuple[subprocess.Popen[bytes], int, int]:
    """The server process, its port, and the pid whose CPU to count (the server's, also under a profiler;
    with its worker processes)."""
    port = free_port()
    (workdir / "gpumode_bench_app.py").write_text(FACTORY)
    command = [sys.executable, "-c", SERVER, url, str(port), str(processes), str(workdir)]
    proc = subprocess.Popen([*(profile or []), *command])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                pid = _server_pid(proc.pid) if profile else proc.pid
                # every worker up: each answers /healthz only once its app started
                while len(_tree(pid)) < (1 if processes == 1 else processes + 1):
                    time.sleep(0.2)
                time.sleep(1.0 if processes > 1 else 0)
                return proc, port, pid
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.terminate()
    raise RuntimeError("server did not come up within 90 s")


def stop_server(proc: subprocess.Popen[bytes], pid: int) -> None:
    # Under a profiler, stop the server itself: the profiler then writes what it saw and exits.
    os.kill(pid, signal.SIGTERM)
    proc.wait(60)


def _server_pid(parent: int) -> int:
    """The Python child a profiler started."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return int(children[0]) if children else parent


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (uvicorn's worker processes)."""
    found = [pid]
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += _tree(int(child))
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process: the server's cost per report, whatever else shares the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> dict[int, float]:
    found = {}
    for p in _tree(pid):
        with contextlib.suppress(OSError):
            found[p] = cpu_seconds(p)
    return found


def rss_mb(pid: int) -> float:
    """Resident memory of the server, all its processes."""
    total = 0
    for p in _tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


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
    server_rss_mb: float = 0.0
    processes: int = 1

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
    """Run the load generator in its own process and read its result; the server's (all its processes) and
    the database's CPU are taken around it."""
    jobs_file, result_file = workdir / "jobs.pickle", workdir / "result.json"
    with jobs_file.open("wb") as f:
        pickle.dump({"host": "127.0.0.1", "port": port, **spec}, f)
    db_before = database_cpu(backend)
    before = tree_cpu_seconds(pid)
    subprocess.run([sys.executable, str(LOADGEN), str(jobs_file), str(result_file)], check=True)
    after = tree_cpu_seconds(pid)
    server_cpu = sum(cpu - before.get(p, 0.0) for p, cpu in after.items())
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
        server_rss_mb=rss_mb(pid),
        processes=len(after) - 1 if len(after) > 1 else 1,
    )


def request(name: str, token: str, body: bytes) -> bytes:
    head = (
        f"POST /api/v1/nodes/{name}/report HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def bodies(names: list[str], gpus: int, variant: int) -> dict[str, bytes]:
    """Synthetic report bodies: the snapshot's JSON with the host's VMs beside it."""
    template = snapshot("template", gpus, variant=variant).to_dict()
    out = {}
    for name in names:
        snap = HostSnapshot.from_dict({**template, "hostname": name})
        snap.fingerprint = snap.compute_fingerprint()
        out[name] = json.dumps({**snap.to_dict(), "vms": vms(name, gpus)}).encode()
    return out


UNCHANGED, CHANGED = b'"changed":false', b'"changed":true'


def _fingerprint(body: bytes) -> str:
    found: str = json.loads(body)["fingerprint"]
    return found


def run_backend(name: str, fleet: Fleet, args: argparse.Namespace, workdir: Path) -> dict[str, Result] | None:
    backend = make_backend(name, workdir)
    if backend is None:
        return None
    try:
        t0 = time.perf_counter()
        seed(backend.url, fleet)
        print(
            f"{name}/{fleet.kind}: seeded {len(fleet.order)} hosts in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        order, tokens = fleet.order, fleet.tokens
        profile = None
        if args.py_spy:
            out = Path(args.profile_dir) / f"{name}-{fleet.kind}.txt"
            options = ["--nonblocking", "--gil", "--format", "raw", "--rate", "100", "-o", str(out)]
            profile = [args.py_spy, "record", *options, "--"]
        plain = {n: request(n, tokens[n], fleet.base[n]) for n in order}  # shared: pickled once each
        other = {n: request(n, tokens[n], fleet.changed[n]) for n in order}
        # A change of VMs only is answered "changed": false (VMs are not hardware).
        expect = {
            n: CHANGED if _fingerprint(fleet.base[n]) != _fingerprint(fleet.changed[n]) else UNCHANGED
            for n in order
        }
        first = [(plain[n], UNCHANGED) for n in order]
        closed8 = {"mode": "closed", "jobs": first, "conns": 8, "seconds": 600}
        results: dict[str, Result] = {}
        proc, port, pid = start_server(backend.url, profile, workdir)
        try:
            results["first pass, new bodies"] = generate(port, closed8, pid, backend, workdir)
        finally:
            stop_server(proc, pid)
        proc, port, pid = start_server(backend.url, profile, workdir)
        state: dict[str, int] = {}  # which of its two bodies each host sent last (0: base)

        def flips(count: int) -> list[tuple[bytes, bytes]]:
            """Each host's next body, in turn; ``sent`` tells how many the server really got."""
            jobs, sending = [], dict(state)
            for n in _cycle(order, count):
                sending[n] = 1 - sending.get(n, 0)
                jobs.append((other[n] if sending[n] else plain[n], expect[n]))
            return jobs

        def sent(result: Result) -> Result:
            for n in _cycle(order, result.done):
                state[n] = 1 - state.get(n, 0)
            return result

        try:
            results["first pass"] = generate(port, closed8, pid, backend, workdir)
            steady = [(plain[n], UNCHANGED) for n in _cycle(order, _count(args, args.rate))]
            results["unchanged"] = generate(port, _spec(args, steady, args.rate), pid, backend, workdir)
            changed = flips(_count(args, args.changed_rate))
            results["changed"] = sent(
                generate(port, _spec(args, changed, args.changed_rate), pid, backend, workdir)
            )
        finally:
            stop_server(proc, pid)
        if backend.cleanup:  # PostgreSQL: N server processes sharing the fleet
            for processes in args.processes:
                proc, port, pid = start_server(backend.url, None, workdir, processes)
                try:
                    spec = {
                        "mode": "closed",
                        "jobs": flips(round(CLOSED_MAX_RATE * args.seconds)),
                        "conns": args.concurrency,
                        "seconds": args.seconds,
                    }
                    results[f"changed x{processes}"] = sent(generate(port, spec, pid, backend, workdir))
                finally:
                    stop_server(proc, pid)
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


SCENARIOS = ("first pass, new bodies", "first pass", "unchanged", "changed")


def report(results: dict[str, dict[str, Result]], args: argparse.Namespace, loads: list[str]) -> bool:
    """One table: a column per database, body kind and scenario; then the process counts; then targets."""
    columns = [(run, s) for run in results for s in SCENARIOS if s in results[run]]
    print()
    print(f"cores: {os.cpu_count()}; load average (1/5/15 min) " + "; ".join(loads))
    rows: tuple[tuple[str, Callable[[Result], str]], ...] = (
        ("loop", lambda r: "open" if r.mode == "open" else "closed"),
        ("offered reports/s", lambda r: f"{r.offered:.0f}" if r.mode == "open" else "max"),
        ("achieved reports/s", lambda r: f"{r.achieved:.0f}"),
        ("reports (errors)", lambda r: f"{r.done} ({r.errors})"),
        ("p50 ms", lambda r: f"{r.pct(50):.1f}"),
        ("p99 ms", lambda r: f"{r.pct(99):.1f}"),
        ("max ms", lambda r: f"{max(r.latencies_ms, default=0):.1f}"),
        ("server CPU ms/report", lambda r: f"{r.per_report_ms(r.server_cpu_s):.2f}"),
        (
            "postgres CPU ms/report >=",  # backends that exit during a run take theirs along
            lambda r: "-" if r.database_cpu_s is None else f"{r.per_report_ms(r.database_cpu_s):.2f}",
        ),
        ("generator CPU ms/report", lambda r: f"{r.per_report_ms(r.generator_cpu_s):.2f}"),
        ("generator late p99 ms", lambda r: f"{r.pct(99, r.late_ms):.1f}" if r.late_ms else "-"),
        ("server RSS MB", lambda r: f"{r.server_rss_mb:.0f}"),
    )
    width = 24
    for chunk in range(0, len(columns), 4):
        part = columns[chunk : chunk + 4]
        print()
        print(f"{'':27}" + "".join(f"{run:>{width}}" for run, _ in part))
        print(f"{'':27}" + "".join(f"{s:>{width}}" for _, s in part))
        for label, value in rows:
            print(f"{label:27}" + "".join(f"{value(results[run][s]):>{width}}" for run, s in part))
    scaled = [
        (run, s, r) for run, per in results.items() for s, r in per.items() if s.startswith("changed x")
    ]
    if scaled:
        print()
        print(
            f"changed reports, closed loop x{args.concurrency}, `gpumode server --workers N` on PostgreSQL:"
        )
        print(
            f"{'':22}{'processes':>10}{'reports/s':>11}{'per process':>13}{'p99 ms':>9}"
            f"{'server CPU ms':>15}{'postgres CPU ms':>17}{'errors':>8}"
        )
        for run, s, r in scaled:
            n = int(s.rsplit("x", 1)[1])
            db_ms = "-" if r.database_cpu_s is None else f"{r.per_report_ms(r.database_cpu_s):.2f}"
            print(
                f"{run:22}{n:>10}{r.achieved:>11.0f}{r.achieved / n:>13.0f}{r.pct(99):>9.1f}"
                f"{r.per_report_ms(r.server_cpu_s):>15.2f}{db_ms:>17}{r.errors:>8}"
            )
    print()
    ok = True
    for run, per in results.items():
        r = per["unchanged"]
        target = (
            f"{run}: unchanged target ({TARGET_RPS:.0f}/s open loop, p99 < {TARGET_P99_MS:.0f} ms, no errors)"
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
    parser.add_argument("--hosts", type=int, default=2_000)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per synthetic host")
    parser.add_argument("--bodies", default="real,synthetic", help="real (emulated fixtures), synthetic")
    parser.add_argument("--rate", type=float, default=TARGET_RPS, help="unchanged reports/s (open loop)")
    parser.add_argument("--changed-rate", type=float, default=50.0, help="changed reports/s (open loop)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each scenario")
    parser.add_argument("--closed", action="store_true", help="closed loop: maximum throughput")
    parser.add_argument("--concurrency", type=int, default=16, help="clients in closed-loop runs")
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument(
        "--processes", default="1,2,4", help="server processes to compare on PostgreSQL ('' for none)"
    )
    parser.add_argument(
        "--cache",
        default=str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpumode-bench"),
        help="where the real bodies are kept between runs",
    )
    parser.add_argument("--py-spy", help="profile the server with this py-spy binary (slows it down)")
    parser.add_argument("--profile-dir", default=".", help="where py-spy writes <backend>-<bodies>.txt")
    args = parser.parse_args()
    args.processes = [int(p) for p in args.processes.split(",") if p.strip()]
    print(f"command: {' '.join(sys.argv)}", file=sys.stderr)
    names = [host_name(i) for i in range(args.hosts)]
    random.Random(7).shuffle(names)  # hosts report in a fixed random order, each at most once per cycle
    results: dict[str, dict[str, Result]] = {}
    loads = []
    with tempfile.TemporaryDirectory(prefix="gpumode-bench-") as tmp:
        for kind in [k.strip() for k in args.bodies.split(",") if k.strip()]:
            t0 = time.perf_counter()
            fleet = (
                real_fleet(names, Path(args.cache)) if kind == "real" else synthetic_fleet(names, args.gpus)
            )
            sizes = sorted(len(b) for b in fleet.base.values())
            print(
                f"{kind} bodies: {len(names)} hosts, {sizes[len(sizes) // 2] / 1024:.0f} KB median, "
                f"{sizes[-1] / 1024:.0f} KB largest, made in {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
            )
            for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
                loads.append(f"{name}/{kind} start {loadavg()}")
                fleet.tokens = {}
                got = run_backend(name, fleet, args, Path(tmp))
                if got is not None:
                    results[f"{name} {kind}"] = got
                    print(f"--- {name} {kind} (all runs together at the end)")
                    report({f"{name} {kind}": got}, args, [*loads, f"now {loadavg()}"])
                    sys.stdout.flush()
    loads.append(f"end {loadavg()}")
    if not results:
        return 2
    return 0 if report(results, args, loads) else 1


if __name__ == "__main__":
    sys.exit(main())
