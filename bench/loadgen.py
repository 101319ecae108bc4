"""A lean HTTP/1.1 load generator for ``bench/sync.py``, run in a process of its own.

    python bench/loadgen.py JOBS.pickle RESULT.json

Open loop (``mode = "open"``): request *i* is due at ``t0 + i / rate`` and is sent then, whether or not
earlier requests have returned; its latency counts from when it was *due*, so a server that falls behind
cannot hide its queue by slowing the generator down (coordinated omission). Requests still unanswered
``drain`` seconds after the last one was due count as timeouts. Closed loop (``mode = "closed"``): ``conns``
workers send back to back for ``seconds``; this measures the most the server can take, latency from the actual
send.

Times come from ``time.perf_counter`` (uvloop's ``loop.time()`` counts whole milliseconds). Requests are
pre-built bytes written to keep-alive connections and answers are read by hand (status line,
``content-length``, body): the generator shares the machine's cores with the server, and httpx costs about as
much CPU per request as the server's unchanged path. Its own CPU time is reported so readers can check.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import resource
import sys
from time import perf_counter as now
from typing import Any

import uvloop

# One request: the full HTTP/1.1 request bytes, and bytes its 200 answer must contain.
Job = tuple[bytes, bytes]


class Pool:
    """Keep-alive connections to one server, at most ``limit`` open; a broken one is replaced."""

    def __init__(self, host: str, port: int, limit: int) -> None:
        self.host, self.port, self.limit = host, port, limit
        self.idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self.open = 0

    async def fill(self, count: int) -> None:
        """Open connections before the clock starts, so connecting is not charged to the first requests."""
        for _ in range(min(count, self.limit) - self.open):
            self.open += 1
            self.idle.put_nowait(await asyncio.open_connection(self.host, self.port))

    async def get(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.idle.empty() and self.open < self.limit:
            self.open += 1
            try:
                return await asyncio.open_connection(self.host, self.port)
            except OSError:
                self.open -= 1
                raise
        return await self.idle.get()

    def put(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.idle.put_nowait(conn)

    def drop(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        conn[1].close()
        self.open -= 1


async def exchange(pool: Pool, job: Job) -> str | None:
    """Send one request and read its answer; ``None`` when it is a 200 with the expected body, else what was
    wrong (kept for the report)."""
    request, expect = job
    conn = await pool.get()
    reader, writer = conn
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        lower = head.lower()
        at = lower.find(b"content-length:")
        length = int(lower[at + 15 : lower.find(b"\r\n", at)]) if at >= 0 else 0
        body = await reader.readexactly(length)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        pool.drop(conn)
        return f"{exc.__class__.__name__}: {exc}"
    pool.put(conn)
    status = head[9:12]
    if status != b"200" or expect not in body:
        return f"{status.decode(errors='replace')}: {body[:200].decode(errors='replace')}"
    return None


async def open_loop(spec: dict[str, Any]) -> dict[str, Any]:
    jobs: list[Job] = spec["jobs"]
    rate: float = spec["rate"]
    pool = Pool(spec["host"], spec["port"], spec["conns"])
    await pool.fill(spec["warm_conns"])
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    late: list[float] = []
    failures: list[str] = []
    last_done = 0.0

    async def one(due: float, job: Job) -> None:
        nonlocal last_done
        try:
            problem = await exchange(pool, job)
        except OSError as exc:
            problem = f"{exc.__class__.__name__}: {exc}"
        last_done = now()
        latencies.append((last_done - due) * 1000)
        if problem is not None:
            failures.append(problem)

    cpu = _cpu()
    t0 = now() + 0.05
    tasks = []
    for i, job in enumerate(jobs):
        due = t0 + i / rate
        wait = due - now()
        if wait > 0:
            await asyncio.sleep(wait)
        late.append((now() - due) * 1000)  # how far the generator itself is behind its schedule
        tasks.append(loop.create_task(one(due, job)))
    _, pending = await asyncio.wait(tasks, timeout=spec["drain"]) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    return {
        "sent": len(jobs),
        "latencies_ms": latencies,
        "failures": failures,
        "timeouts": len(pending),
        "seconds": (last_done - t0) if latencies else 0.0,
        "generator_cpu_s": _cpu() - cpu,
        "late_ms": late,
    }


async def closed_loop(spec: dict[str, Any]) -> dict[str, Any]:
    jobs: list[Job] = spec["jobs"]
    pool = Pool(spec["host"], spec["port"], spec["conns"])
    await pool.fill(spec["conns"])
    latencies: list[float] = []
    failures: list[str] = []
    following = iter(jobs)
    cpu = _cpu()
    started = now()
    deadline = started + spec["seconds"]

    async def worker() -> None:
        for job in following:  # one shared iterator: the workers take jobs in order, none twice
            if now() > deadline:
                return
            sent = now()
            problem = await exchange(pool, job)
            latencies.append((now() - sent) * 1000)
            if problem is not None:
                failures.append(problem)

    await asyncio.gather(*(worker() for _ in range(spec["conns"])))
    return {
        "sent": len(latencies),
        "latencies_ms": latencies,
        "failures": failures,
        "timeouts": 0,
        "seconds": now() - started,
        "generator_cpu_s": _cpu() - cpu,
        "late_ms": [],
    }


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        spec = pickle.load(f)
    run = open_loop if spec["mode"] == "open" else closed_loop
    result = uvloop.run(run(spec))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
