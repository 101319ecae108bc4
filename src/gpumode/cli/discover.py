"""`gpumode discover`: show what a host is made of and what state its GPUs are in.

Discovery is imported inside the command and ``--json`` writes plain text to stdout, so neither the import of
the CLI nor the JSON path pays for Rich: ``gpumode discover --json`` stays well under the 300 ms budget the
agent and scripts rely on. The Rich view (:mod:`gpumode.cli.discover_view`-style code kept below) is only
imported when a person asks for it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from gpumode.domain import HostSnapshot, PciFunction

_MODE_STYLE = {"accel": "green", "vgpu": "cyan", "passthrough": "magenta", "none": "dim"}


def discover(
    root: Path = typer.Option(
        Path("/"), "--root", help="Root of the host to read (an emulated host's directory)."
    ),
    json_out: bool = typer.Option(
        False, "--json", help="Print the snapshot as JSON (docs/snapshot-schema.md)."
    ),
) -> None:
    """Show the host's PCI functions, GPUs and driver state."""
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        sys.stderr.write(f"gpumode discover: --root {root} {what}\n")
        raise typer.Exit(2)
    from gpumode.host.discover import discover as read_host

    snapshot = read_host(root)
    if json_out:
        sys.stdout.write(snapshot.to_json(indent=2) + "\n")
        return
    from rich.console import Console

    # Piped output has no terminal width to fit: give it room rather than Rich's 80-column default.
    console = Console(highlight=False) if sys.stdout.isatty() else Console(width=120, highlight=False)
    render(snapshot, console)


def render(snapshot: HostSnapshot, console: Console) -> None:
    """The person-sized view: header, GPUs, NVSwitches, other functions, problems."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    nv = snapshot.nvidia
    driver = "not loaded"
    if nv.loaded:
        build = "open" if nv.open_kernel_module else "proprietary" if nv.open_kernel_module is False else "?"
        driver = f"{nv.flavour or '?'} {nv.version or '?'} ({build})"
    elif nv.flavour:
        driver = f"not loaded ({nv.flavour} packages installed)"
    # only running units: a colour alone would not tell them apart on a terminal without colour
    services = ", ".join(unit.removesuffix(".service") for unit, active in nv.services.items() if active)
    console.print(
        f"[bold]{snapshot.hostname or '?'}[/]  kernel {snapshot.kernel or '?'}  "
        f"driver state [bold]{snapshot.driver_state}[/]"
    )
    console.print(f"nvidia: {driver}" + f"  services running: {services or 'none'}")

    by_address = {fn.address: fn for fn in snapshot.functions}
    if snapshot.gpus:
        table = Table(title=f"GPUs ({len(snapshot.gpus)})", title_justify="left", box=box.SIMPLE_HEAD)
        for column in ("address", "model", "NUMA", "group", "driver", "mode", "companions", "VFs / vGPUs"):
            table.add_column(column, no_wrap=column in ("address", "model", "driver", "mode"))
        for gpu in snapshot.gpus:
            vgpu = []
            if gpu.vfs:
                vgpu.append(f"{len(gpu.vfs)} VFs")
            if gpu.vgpus:
                vgpu.append(f"{len(gpu.vgpus)} vGPU VFs")
            if gpu.mdevs:
                vgpu.append(f"{len(gpu.mdevs)} mdevs")
            style = _MODE_STYLE.get(str(gpu.mode), "")
            table.add_row(
                gpu.address,
                _short_model(gpu.name),
                _opt(gpu.numa_node),
                _opt(gpu.iommu_group),
                gpu.driver or "-",
                f"[{style}]{gpu.mode}[/]" if style else str(gpu.mode),
                ", ".join(gpu.companions) or "-",
                ", ".join(vgpu) or "-",
            )
        console.print(table)
    else:
        console.print("[dim]no NVIDIA GPU[/]")

    if snapshot.nvswitches:
        switches = [f"{a} ({by_address[a].driver or 'no driver'})" for a in snapshot.nvswitches]
        console.print(f"NVSwitches ({len(switches)}): " + ", ".join(switches))

    shown = set(snapshot.nvswitches) | {g.address for g in snapshot.gpus}
    for gpu in snapshot.gpus:
        shown.update(gpu.vfs)
    others = [fn for fn in snapshot.functions if fn.address not in shown]
    if others:
        # A big host has a hundred bridges and platform functions: one row per kind keeps it at a glance.
        kinds: dict[tuple[str, str], list[PciFunction]] = {}
        for fn in others:
            kinds.setdefault((fn.class_name or _hex(fn.class_code, 6), fn.driver or "-"), []).append(fn)
        table = Table(title=f"Other functions ({len(others)})", title_justify="left", box=box.SIMPLE_HEAD)
        widths = {
            "n": (3, 4),
            "class": (10, 24),
            "driver": (8, 14),
            "device": (10, 30),
            "addresses": (12, 30),
        }
        for column, (least, most) in widths.items():
            table.add_column(column, overflow="ellipsis", no_wrap=True, min_width=least, max_width=most)
        for (class_name, driver), fns in sorted(kinds.items()):
            names = {fn.device_name or fn.vendor_name or "-" for fn in fns}
            device = names.pop() if len(names) == 1 else f"{len(names) + 1} kinds"
            listed = fns[0].address + (f" +{len(fns) - 1}" if len(fns) > 1 else "")
            table.add_row(str(len(fns)), class_name, driver, device, listed)
        console.print(table)

    if snapshot.problems:
        console.print(f"[yellow]Problems ({len(snapshot.problems)}):[/]")
        for problem in snapshot.problems:
            # problems quote file contents: never let them be read as markup
            console.print(Text.assemble(("  • ", "yellow"), problem))


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def _hex(value: int, width: int = 4) -> str:
    return "?" if value < 0 else f"{value:0{width}x}"


def _short_model(name: str) -> str:
    """``GH100 [H200 SXM 141GB]`` → ``H200 SXM 141GB``: the name a person knows the card by."""
    if name.endswith("]") and "[" in name:
        return name[name.rindex("[") + 1 : -1]
    return name
