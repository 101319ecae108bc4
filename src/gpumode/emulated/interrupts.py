"""Interrupting an emulated command while it runs: the signal points of the emulated userspace.

A test writes ``DIR/.gpumode-emulated/signals.json`` (:func:`inject_command_signal`): the next command whose
argv starts with a prefix gets a signal at a named point, from the process that runs it, as a Ctrl-C, a
``systemctl stop`` of the agent or a crash would arrive while the real tool runs. Points: ``start``
(before the command does anything), ``middle`` (halfway through its work: each tool says where, e.g.
``sriov-manage`` right after it wrote ``sriov_numvfs`` with the PF still on pci-pf-stub), ``end``
(its work done, just before it returns). Each injected point fires once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from gpumode.host.root import EMULATION_MARKER

SIGNALS_FILE = "signals.json"
POINTS = ("start", "middle", "end")
SIGNALS = ("SIGINT", "SIGTERM", "SIGKILL")

_current = threading.local()  # the argv of the command this thread is running


def inject_command_signal(root: Path, prefix: str, point: str, signame: str = "SIGKILL") -> None:
    """The next command whose argv starts with ``prefix`` (shell-split words; the first may be the tool's
    bare name) gets ``signame`` at ``point``."""
    words = shlex.split(prefix)
    if not words:
        raise ValueError("a signal point needs a command prefix, e.g. 'sriov-manage -e'")
    if point not in POINTS:
        raise ValueError(f"unknown point {point!r}: one of {', '.join(POINTS)}")
    if signame not in SIGNALS:
        raise ValueError(f"unsupported signal {signame!r}: one of {', '.join(SIGNALS)}")
    path = Path(root) / EMULATION_MARKER / SIGNALS_FILE
    points = json.loads(path.read_text()) if path.exists() else {}
    points[" ".join(words)] = {"point": point, "signal": signame}
    path.write_text(json.dumps(points, indent=1, sort_keys=True))


@contextlib.contextmanager
def current_command(argv: tuple[str, ...]) -> Iterator[None]:
    """While the userspace answers ``argv``: the command a ``middle`` point belongs to."""
    _current.argv = argv
    try:
        yield
    finally:
        _current.argv = ()


def signal_point(root: Path, point: str) -> None:
    """A point where the running command may be interrupted; a no-op unless a test asked for it."""
    argv: tuple[str, ...] = getattr(_current, "argv", ())
    path = Path(root) / EMULATION_MARKER / SIGNALS_FILE
    if not argv or not path.exists():
        return
    points = json.loads(path.read_text())
    bare = [os.path.basename(argv[0]), *argv[1:]]  # `sriov-manage -e` matches /usr/lib/nvidia/sriov-manage
    for prefix, spec in points.items():
        words = prefix.split()
        if words not in (list(argv[: len(words)]), bare[: len(words)]) or spec.get("point") != point:
            continue
        del points[prefix]
        if points:
            path.write_text(json.dumps(points, indent=1, sort_keys=True))
        else:
            path.unlink()
        os.kill(os.getpid(), signal.Signals[str(spec["signal"])])
        return
