"""The host seen through one injectable root directory.

Every path gpumode uses on a host is derived from :attr:`Host.root` (like mdevctl's environment root), so
tests and the demo point it at an emulated tree. Reads are plain file reads everywhere. Every write to the
kernel goes through :meth:`Host.write` and every command through :meth:`Host.run`: on a real host they hit the
kernel and the shell; on an emulated host (a root holding ``.gpumode-emulated/``) they are handed to the
emulated kernel and userspace, which react as the real ones do, errnos included.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

EMULATION_MARKER = ".gpumode-emulated"


@dataclass(frozen=True, slots=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandError(RuntimeError):
    """A command run on the host failed; carries its result so callers can show stderr."""

    def __init__(self, result: CommandResult) -> None:
        self.result = result
        detail = (result.stderr or result.stdout).strip().splitlines()
        tail = detail[-1] if detail else "no output"
        super().__init__(f"`{' '.join(result.argv)}` exited {result.returncode}: {tail}")


class CommandTimeout(CommandError):
    """A command ran past its timeout and was killed. ``still_running`` when even SIGKILL did not end it at
    once (a process waiting in the kernel for a device's users, like ``rmmod`` of a driver whose device a VM
    holds): it ends when the kernel lets it; ``process`` is its handle."""

    def __init__(self, result: CommandResult, process: subprocess.Popen[str], still_running: bool) -> None:
        super().__init__(result)
        self.process = process
        self.still_running = still_running


class WriteBlocked(OSError):
    """A kernel write did not return within its deadline (it is still pending in a helper thread, and
    completes in the kernel whenever what it waits for goes away)."""

    def __init__(self, path: Path, deadline: float, pending: threading.Thread) -> None:
        super().__init__(errno.ETIMEDOUT, f"write still blocked after {deadline:g} s", str(path))
        self.pending = pending


class Host:
    """One Linux host under ``root`` (``/`` for the machine itself)."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)
        self.emulated = (self.root / EMULATION_MARKER).is_dir()

    def __repr__(self) -> str:
        kind = "emulated" if self.emulated else "real"
        return f"Host({str(self.root)!r}, {kind})"

    def path(self, *parts: str) -> Path:
        """A path under the root; ``parts`` are relative (``"sys/bus/pci/devices"``)."""
        return self.root.joinpath(*(p.lstrip("/") for p in parts))

    @property
    def sys(self) -> Path:
        return self.root / "sys"

    @property
    def proc(self) -> Path:
        return self.root / "proc"

    def relative(self, path: Path) -> str:
        """``path`` as seen from the root (``sys/bus/pci/...``), for messages and the emulated kernel.

        A path reached through a symlink (a resolved sysfs link, a root under a symlinked directory) is
        compared on both sides' real paths, so it never comes out as ``../../sys/...``."""
        rel = os.path.relpath(path, self.root)
        if rel == ".." or rel.startswith("../"):
            real = os.path.relpath(os.path.realpath(path), os.path.realpath(self.root))
            if real != ".." and not real.startswith("../"):
                return real
        return rel

    def write(self, path: Path, value: str, *, deadline: float | None = None) -> None:
        """Write ``value`` to a kernel file (sysfs/procfs); raises :class:`OSError` with the kernel's errno.

        This is the single write path: each write is one ``write(2)`` call, as ``echo`` would do, so a kernel
        attribute sees exactly one store. With ``deadline`` (seconds) the write runs in a helper thread and
        :class:`WriteBlocked` is raised when it has not returned by then: a driver's remove() can wait for its
        users without end, in a sleep no signal ends, so the thread is left to finish with the kernel.
        """
        if self.emulated:
            from gpumode.emulated.kernel import EmulatedKernel

            EmulatedKernel(self.root).write(self.relative(path), value)
            return
        if deadline is None:
            _write_once(path, value)
            return
        failure: list[OSError] = []

        def attempt() -> None:
            try:
                _write_once(path, value)
            except OSError as exc:
                failure.append(exc)

        thread = threading.Thread(target=attempt, name=f"write {path}", daemon=True)
        thread.start()
        thread.join(deadline)
        if thread.is_alive():
            raise WriteBlocked(path, deadline, thread)
        if failure:
            raise failure[0]

    def run(self, argv: Sequence[str], *, timeout: float | None = 600, check: bool = False) -> CommandResult:
        """Run a command on the host. On an emulated host the emulated userspace answers it."""
        if self.emulated:
            from gpumode.emulated.userspace import run_emulated

            result = run_emulated(self.root, tuple(argv))
        else:
            result = _run_real(tuple(argv), timeout)
        if check and not result.ok:
            raise CommandError(result)
        return result


def _write_once(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _run_real(argv: tuple[str, ...], timeout: float | None) -> CommandResult:
    """``subprocess.run`` without its wait after a kill: a process stuck in the kernel outlives SIGKILL."""
    # its own process group: a Ctrl-C at the terminal reaches gpumode (which finishes the step), not the
    # command, so a tool like sriov-manage is never cut off halfway by it
    proc = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            stdout, stderr = proc.communicate(timeout=5)
            still_running = False
        except subprocess.TimeoutExpired:
            stdout, stderr, still_running = "", "", True
        note = " and is still running (waiting in the kernel)" if still_running else ""
        result = CommandResult(argv, -9, stdout, f"{stderr}timed out after {timeout:g} s{note}\n")
        raise CommandTimeout(result, proc, still_running) from None
    return CommandResult(argv, proc.returncode, stdout, stderr)
