"""`gpumode discover` (being written)."""

import typer


def discover(root: str = typer.Option("/", help="Host root directory")) -> None:
    """Show the host's PCI functions, GPUs and driver state."""
    raise typer.Exit(2)
