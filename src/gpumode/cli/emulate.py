"""`gpumode emulate`: list the emulated host fixtures and create one in a directory.

An emulated host is a directory laid out like a real host's /sys, /proc, /lib/modules, dpkg and systemd state,
with an emulated kernel and userspace answering writes and commands; every other gpumode command takes
``--root DIR`` to act on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

app = typer.Typer(help="Create and list emulated hosts.", no_args_is_help=True)


@app.command("list")
def list_fixtures() -> None:
    """Show the fixtures: GPUs, PCI functions, the mode they start in, and what they are."""
    from rich.console import Console
    from rich.table import Table

    from gpumode.emulated.fixtures import FIXTURES, gpu_addresses, starting_mode

    table = Table(title="Emulated host fixtures")
    for column in ("name", "GPUs", "functions", "starting mode", "description"):
        table.add_column(column, justify="right" if column in ("GPUs", "functions") else "left")
    for name, build in FIXTURES.items():
        spec = build()
        table.add_row(
            name, str(len(gpu_addresses(spec))), str(len(spec.devices)), starting_mode(spec), spec.description
        )
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(table)


@app.command("create")
def create(
    fixture: str = typer.Argument(..., help="Fixture name (see `gpumode emulate list`)."),
    directory: Path = typer.Argument(..., help="Where to create the host: a new or empty directory."),
) -> None:
    """Create an emulated host from a fixture in DIRECTORY."""
    from gpumode.emulated.create import CreateError, create_host
    from gpumode.emulated.fixtures import UnknownFixtureError, get_fixture, starting_mode

    try:
        spec = get_fixture(fixture)
    except UnknownFixtureError as exc:
        sys.stderr.write(f"gpumode emulate create: {exc}\n")
        raise typer.Exit(2) from None
    try:
        host = create_host(spec, directory)
    except CreateError as exc:
        sys.stderr.write(f"gpumode emulate create: {exc}\n")
        raise typer.Exit(2) from None
    from gpumode.emulated.hypervisor import EmulatedHypervisor

    vms = EmulatedHypervisor(host).list_vms()
    running = sum(vm.running for vm in vms)
    sys.stdout.write(
        f"Created emulated host {spec.hostname!r} ({fixture}: {spec.description}) in {directory}\n"
        f"  {len(spec.devices)} PCI functions, GPUs in {starting_mode(spec)} mode, "
        f"packages: {', '.join(spec.packages) or 'none'}\n"
        f"  services running: {', '.join(spec.services) or 'none'}; VMs: {len(vms)} ({running} running)\n"
        f"Next: gpumode discover --root {directory}\n"
    )
