"""How much time does the mode engine itself add to a switch? Run: ``python bench/switch.py [fixture ...]``.

For each fixture it creates an emulated host, switches it through every mode it allows (in-process, the same
engine code the CLI runs) and prints, per step, the emulated host operation's own duration next to the
engine's overhead around it: the checks before and after, and the journal writes (atomic write + fsync each).
Discovery, done once per plan (twice when the request is validated before taking the lock), is reported per
plan and spread over its steps (listed separately). The target is < 5 ms of engine overhead per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpumode.domain import Mode, SwitchRequest
from gpumode.emulated.create import create_host
from gpumode.host.root import Host
from gpumode.modes import engine
from gpumode.modes.journal import atomic_write
from gpumode.modes.policy import RequestError

FIXTURES = ("hgx-h100", "a16-vdi", "l40s-sriov", "t4-mdev", "rtx-workstation")
TARGET_MS = 5.0


def bench_fixture(name: str, workdir: Path, console: Console, discoveries: list[float]) -> list[float]:
    """Switch one emulated host through its modes; print the per-step table; return the engine's overhead
    per step in ms (checks + journal), and add each plan's discovery time per step to ``discoveries``."""
    host = create_host(name, workdir / name)
    table = Table(title=f"{name}", title_justify="left")
    for col in ("plan", "step", "action", "host op ms", "check ms", "journal ms", "writes", "overhead ms"):
        table.add_column(col, justify="right" if "ms" in col or col == "writes" else "left")
    overheads: list[float] = []
    for mode in (Mode.PASSTHROUGH, Mode.VGPU, Mode.ACCEL, Mode.PASSTHROUGH):
        try:
            t = time.perf_counter()
            result = engine.apply(host, _request(host, mode))
            total_s = time.perf_counter() - t
        except RequestError as exc:
            console.print(f"[dim]{name}: {mode.value} not possible here ({exc.code})[/]")
            continue
        assert result.run is not None
        if not result.ok:
            console.print(f"[red]{name}: switch to {mode.value} failed: {result.run.error}[/]")
            continue
        steps = result.run.timings
        discoveries.append(result.discovery_s * 1000 / max(len(steps), 1))
        for timing in steps:
            overhead = (timing.check_s + timing.journal_s) * 1000
            overheads.append(overhead)
            table.add_row(
                mode.value,
                timing.step_id,
                timing.action,
                f"{timing.work_s * 1000:.2f}",
                f"{timing.check_s * 1000:.2f}",
                f"{timing.journal_s * 1000:.2f}",
                str(timing.journal_writes),
                f"{overhead:.2f}",
            )
        table.add_row(
            mode.value, "[b]plan[/]", f"discovery {result.discovery_s * 1000:.1f} ms", "", "", "", "",
            f"total {total_s * 1000:.1f} ms",
        )  # fmt: skip
    console.print(table)
    return overheads


def _request(host: Host, mode: Mode) -> SwitchRequest:
    """The request for ``mode``; for vgpu without a type set yet, the first type the host offers."""
    try:
        engine.plan(host, SwitchRequest(mode))
    except RequestError as exc:
        if exc.code == "vgpu_type_required" and exc.choices:
            return SwitchRequest(mode, vgpu_type=exc.choices[0])
    return SwitchRequest(mode)


def fsync_cost_ms(directory: Path, rounds: int = 20) -> float:
    """What one durable write costs on this disk right now: the floor of a journal save."""
    path = directory / "fsync-probe.json"
    t = time.perf_counter()
    for _ in range(rounds):
        atomic_write(path, "{}", sync_dir=False)
    return (time.perf_counter() - t) * 1000 / rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixtures", nargs="*", default=list(FIXTURES))
    args = parser.parse_args(argv)
    console = Console()
    overheads: list[float] = []
    discoveries: list[float] = []
    with tempfile.TemporaryDirectory(prefix="gpumode-bench-") as tmp:
        for name in args.fixtures:
            overheads += bench_fixture(name, Path(tmp), console, discoveries)
        floor = fsync_cost_ms(Path(tmp))
    if not overheads:
        console.print("[red]no step ran[/]")
        return 1
    mean, worst = statistics.fmean(overheads), max(overheads)
    p95 = sorted(overheads)[int(0.95 * (len(overheads) - 1))]
    verdict = "[green]within[/]" if mean < TARGET_MS else "[red]over[/]"
    console.print(
        f"engine overhead per step (checks + journal) over {len(overheads)} steps: mean {mean:.2f} ms, "
        f"p95 {p95:.2f} ms, max {worst:.2f} ms — {verdict} the {TARGET_MS:g} ms target"
    )
    console.print(f"one durable write (write + fsync + rename) on this disk now: {floor:.2f} ms")
    console.print(
        "discovery, once per plan, spread over its steps: "
        f"mean {statistics.fmean(discoveries):.2f} ms per step"
    )
    return 0 if mean < TARGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
