"""The exit codes of gpumode's commands (docs/cli.md), and the one place a gpumode error becomes one:
:func:`reported` prints ``error [code]: message`` and exits with the code for the error's kind (a Ctrl-C
outside a run's steps exits 130)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

from gpumode.domain import PciAddressError
from gpumode.errors import GpumodeError, Kind

EXIT_FAILED = 1  # it was tried and failed (rolled back, or stopped); a remote job failed; 404, 5xx
EXIT_BAD_INPUT = 2  # bad input: nothing was changed
EXIT_CONFLICT = 3  # not now: another runner holds the host, an unfinished run, a busy node (409)
EXIT_AUTH = 4  # the server said 401 (no or bad token) or 403 (role too low)
EXIT_UNREACHABLE = 5  # no server configured, or it could not be reached
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C

KIND_EXIT = {
    Kind.BAD_INPUT: EXIT_BAD_INPUT,
    Kind.NOT_FOUND: EXIT_FAILED,
    Kind.CONFLICT: EXIT_CONFLICT,
    Kind.FAILED: EXIT_FAILED,
}

err_console = Console(stderr=True)


def exit_code(exc: GpumodeError) -> int:
    return KIND_EXIT[exc.kind]


@contextmanager
def reported() -> Iterator[None]:
    """Turn gpumode's own errors into one line on stderr and the exit code of their kind."""
    try:
        yield
    except GpumodeError as exc:
        from rich.markup import escape

        from gpumode.host.vms import HypervisorUnavailable

        hint = " (--without-hypervisor plans without VMs)" if isinstance(exc, HypervisorUnavailable) else ""
        # escaped: messages carry brackets (`gpumode[libvirt]`); soft-wrapped: one line, however long
        err_console.print(
            f"[bold red]error[/] \\[{exc.code}]: {escape(str(exc))}{hint}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(exit_code(exc)) from None
    except PciAddressError as exc:  # domain's own check (domain imports nothing of ours)
        err_console.print(f"[bold red]error[/] \\[bad_address]: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except KeyboardInterrupt:
        # outside a run's steps (planning, discovery): no step was cut off
        err_console.print(
            "interrupted before any step ran or after the last; `gpumode status` shows whether a run is "
            "unfinished (`gpumode resume` finishes it, `gpumode rollback` undoes it)",
            highlight=False,
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None
