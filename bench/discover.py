"""How fast is discovery? In-process discovery, lspci, a bare-read floor and the whole CLI, side by side.

    .venv/bin/python bench/discover.py                    # builds the hgx-h100 emulated host in a temp dir
    .venv/bin/python bench/discover.py --root /           # this machine
    .venv/bin/python bench/discover.py --root DIR --check # exit 1 when a target is missed

Targets (the issue's): in-process discovery within 2x the floor and faster than one lspci run; the whole
``gpumode discover --json`` process under 300 ms.

The floor is a bare loop doing exactly the filesystem operations one discovery did (recorded through
:class:`gpumode.host.discover.SysReader`): the same opens and reads, readlinks and directory listings, with no
parsing. The few procfs/dpkg reads of the driver facts are left out of it, which only makes the floor
stricter.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gpumode.host.discover import SysReader, discover

PROCESS_BUDGET_MS = 300.0


class Recorder(SysReader):
    """Records every filesystem operation discovery makes, in order."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, str]] = []

    def read(self, path: str) -> str | None:
        self.ops.append(("read", path))
        return super().read(path)

    def readlink(self, path: str) -> str:
        self.ops.append(("readlink", path))
        return super().readlink(path)

    def listdir(self, path: str) -> list[str]:
        self.ops.append(("listdir", path))
        return super().listdir(path)


def floor_loop(ops: list[tuple[str, str]]) -> None:
    """The same operations with nothing around them."""
    for op, path in ops:
        try:
            if op == "read":
                fd = os.open(path, os.O_RDONLY)
                os.read(fd, 65536)
                os.close(fd)
            elif op == "readlink":
                os.readlink(path)
            else:
                os.listdir(path)
        except OSError:
            pass


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    """Wall times of ``repeat`` calls, in milliseconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


def run(argv: list[str]) -> None:
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root", type=Path, help="host root to read (default: build --fixture in a temp dir)"
    )
    parser.add_argument(
        "--fixture", default="hgx-h100", help="emulated fixture to build when --root is not given"
    )
    parser.add_argument("--repeat", type=int, default=20, help="runs per measurement (median is reported)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()

    tmp: str | None = None
    root: Path
    if args.root is None:
        from gpumode.emulated.create import create_host

        tmp = tempfile.mkdtemp(prefix="gpumode-bench-")
        root = Path(tmp) / args.fixture
        print(f"building emulated host {args.fixture!r} in {root} ...", flush=True)
        create_host(args.fixture, root)
    else:
        root = args.root
    try:
        return measure(root, args.repeat, args.check)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def measure(root: Path, repeat: int, check: bool) -> int:
    cold = timed(lambda: discover(root), 1)[0]  # includes the one read of pci.ids
    recorder = Recorder()
    snapshot = discover(root, reader=recorder)
    in_process = statistics.median(timed(lambda: discover(root), repeat))
    floor = statistics.median(timed(lambda: floor_loop(recorder.ops), repeat))

    lspci_ms: float | None = None
    if shutil.which("lspci"):
        argv = ["lspci", "-D", "-nn", "-k", "-A", "linux-sysfs", "-O", f"sysfs.path={root}/sys/bus/pci"]
        lspci_ms = statistics.median(timed(lambda: run(argv), max(3, repeat // 4)))

    gpumode = Path(sys.executable).with_name("gpumode")
    cli = [str(gpumode), "discover", "--json", "--root", str(root)]
    process = statistics.median(timed(lambda: run(cli), max(3, repeat // 4)))

    counts: dict[str, int] = {}
    for op, _ in recorder.ops:
        counts[op] = counts.get(op, 0) + 1
    print(
        f"root {root}: {len(snapshot.functions)} functions, {len(snapshot.gpus)} GPUs; one discovery does "
        + ", ".join(f"{n} {op}" for op, n in sorted(counts.items()))
    )
    rows = [
        ("in-process discovery (median)", in_process),
        ("in-process discovery, first run (reads pci.ids)", cold),
        ("floor: bare loop over the same reads", floor),
        ("lspci -D -nn -k -A linux-sysfs (median)", lspci_ms),
        ("gpumode discover --json, whole process (median)", process),
    ]
    for label, ms in rows:
        print(f"  {label:<52} {'n/a' if ms is None else f'{ms:8.2f} ms'}")

    verdicts = [
        (f"in-process within 2x floor ({in_process / floor:.2f}x)", in_process <= 2 * floor),
        ("in-process faster than one lspci run", lspci_ms is None or in_process < lspci_ms),
        (f"whole process under {PROCESS_BUDGET_MS:.0f} ms", process < PROCESS_BUDGET_MS),
    ]
    for label, ok in verdicts:
        print(f"  {'PASS' if ok else 'MISS'}  {label}")
    return 1 if check and not all(ok for _, ok in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
