"""How fast is the emulated kernel? Run: ``python bench/emulated.py [--fixture hgx-h100] [--rounds 30]``.

On an emulated host of the fixture (default ``hgx-h100``, 180 PCI functions) it times, in this process:
creating the host, one sysfs write (``driver_override`` of a GPU), moving one GPU to ``vfio-pci`` and back
(the writes a passthrough switch makes), ``rmmod``/``modprobe`` of ``vfio_pci``, and the first write of a
process (nothing cached yet). Each is measured twice, side by side: with the render caches (device fragments
memoised by their view, the last tree kept by state text) and with them off (``--no-full`` skips that), which
renders the old and the new state from scratch on every operation as the emulation first did — with today's
cheaper state I/O and file writes, so that column is not the old code's number (docs/emulation.md has those).
Wall time is what callers wait; CPU time is what it costs when the machine is not shared. Exit status 1 when
one write or create_host misses its target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpumode.emulated import kernel as kernel_mod
from gpumode.emulated import sysfs
from gpumode.emulated.create import create_host
from gpumode.emulated.kernel import EmulatedKernel

TARGET_WRITE_MS = 15.0
TARGET_CREATE_S = 1.5


@dataclass
class Timing:
    wall_ms: list[float]
    cpu_ms: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.wall_ms)

    @property
    def p90(self) -> float:
        ordered = sorted(self.wall_ms)
        return ordered[int(0.9 * (len(ordered) - 1))]

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpu_ms)


def measure(action: Callable[[], object], rounds: int, before: Callable[[], object] | None = None) -> Timing:
    wall, cpu = [], []
    for _ in range(rounds):
        if before is not None:
            before()
        w, c = time.perf_counter(), time.process_time()
        action()
        cpu.append((time.process_time() - c) * 1000)
        wall.append((time.perf_counter() - w) * 1000)
    return Timing(wall, cpu)


def alternate(
    first: Callable[[], object], second: Callable[[], object], rounds: int
) -> tuple[Timing, Timing]:
    """Time two operations that undo each other, one after the other."""
    a, b = Timing([], []), Timing([], [])
    for _ in range(rounds):
        for action, into in ((first, a), (second, b)):
            t = measure(action, 1)
            into.wall_ms += t.wall_ms
            into.cpu_ms += t.cpu_ms
    return a, b


def forget_caches() -> None:
    """What a new process starts with: no memoised fragment, no remembered tree."""
    sysfs._DEVICE_MEMO.clear()
    kernel_mod._TREES.clear()


def first_gpu(k: EmulatedKernel) -> str:
    st = k.snapshot()
    return next(d.address for d in st.present_devices() if d.driver == "nvidia" and d.gpu_model is not None)


def bench(fixture: str, rounds: int, workdir: Path) -> dict[str, Timing]:
    """Every measurement with the current caching setting."""
    out: dict[str, Timing] = {}
    made = iter(range(1000))
    out["create_host"] = measure(lambda: create_host(fixture, workdir / f"create-{next(made)}"), 3)
    host = create_host(fixture, workdir / f"host-{next(made)}")
    k = EmulatedKernel(host.root)
    for holder in {h.holder for h in k.handles()}:  # stop the GPU's clients, as a switch would
        k.close_all(holder)
    gpu = first_gpu(k)
    override = f"sys/bus/pci/devices/{gpu}/driver_override"
    values = iter(["vfio-pci\n", "\n"] * rounds * 2)
    k.write(override, next(values))  # warm-up: the first operation renders everything once
    out["one write"] = measure(lambda: k.write(override, next(values)), rounds)
    k.write(override, "\n")

    def to_vfio_and_back() -> None:
        k.write(override, "vfio-pci\n")
        k.write("sys/bus/pci/drivers/nvidia/unbind", gpu)
        k.write("sys/bus/pci/drivers_probe", gpu)
        k.write("sys/bus/pci/drivers/vfio-pci/unbind", gpu)
        k.write(override, "\n")
        k.write("sys/bus/pci/drivers_probe", gpu)

    k.load_module("vfio_pci")  # loads its dependencies too; they stay when vfio_pci goes
    out["GPU to vfio-pci and back: 6 writes"] = measure(to_vfio_and_back, max(3, rounds // 5))
    out["rmmod vfio_pci"], out["modprobe vfio_pci"] = alternate(
        lambda: k.unload_module("vfio_pci"), lambda: k.load_module("vfio_pci"), max(3, rounds // 5)
    )
    out["first write of a process"] = measure(
        lambda: k.write(override, next(values)), max(3, rounds // 5), forget_caches
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", default="hgx-h100")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--no-full", action="store_true", help="skip the from-scratch (uncached) runs")
    args = parser.parse_args(argv)
    console = Console(width=110)
    with tempfile.TemporaryDirectory(prefix="gpumode-bench-") as tmp:
        with sysfs.caching(True):
            cached = bench(args.fixture, args.rounds, Path(tmp) / "cached")
        full: dict[str, Timing] = {}
        if not args.no_full:
            with sysfs.caching(False):
                full = bench(args.fixture, max(5, args.rounds // 3), Path(tmp) / "full")
    table = Table(
        title=f"emulated kernel on {args.fixture} (ms; wall median, p90, CPU median)", title_justify="left"
    )
    for col in ("operation", "cached", "p90", "CPU", "full render", "CPU", "speed-up"):
        table.add_column(col, justify="left" if col == "operation" else "right", no_wrap=True)
    for name, t in cached.items():
        f = full.get(name)
        table.add_row(
            name,
            f"{t.median:.1f}",
            f"{t.p90:.1f}",
            f"{t.cpu:.1f}",
            f"{f.median:.1f}" if f else "-",
            f"{f.cpu:.1f}" if f else "-",
            f"{f.median / t.median:.1f}x" if f else "-",
        )
    console.print(table)
    write_ms = cached["one write"].median
    create_s = cached["create_host"].median / 1000
    ok = write_ms <= TARGET_WRITE_MS and create_s <= TARGET_CREATE_S
    console.print(
        f"one write {write_ms:.1f} ms (target {TARGET_WRITE_MS:g} ms), create_host {create_s:.2f} s "
        f"(target {TARGET_CREATE_S:g} s): " + ("[green]within[/]" if ok else "[red]over[/]")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
