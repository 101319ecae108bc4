"""`switch --wait` / `job --wait` interrupted: the watching stops, the job goes on, and the CLI says how to
follow or stop it."""

from __future__ import annotations

import io
from typing import Any

import pytest
import typer
from rich.console import Console

from gpumode.cli.remote_jobs import EXIT_INTERRUPTED, follow


class CtrlCAfterOnePoll:
    """A client whose second poll is interrupted by the operator's Ctrl-C."""

    def __init__(self) -> None:
        self.calls = 0

    def get(self, path: str) -> dict[str, Any]:
        self.calls += 1
        if self.calls > 1:
            raise KeyboardInterrupt
        return {"id": 7, "node": "n1", "state": "running", "steps": [], "request": {"mode": "accel"}}


def test_interrupted_wait_says_the_job_goes_on() -> None:
    written = io.StringIO()
    console = Console(file=written, width=200, color_system=None)
    with pytest.raises(typer.Exit) as exit_info:
        follow(CtrlCAfterOnePoll(), 7, console, poll_s=0)  # type: ignore[arg-type]
    assert exit_info.value.exit_code == EXIT_INTERRUPTED
    text = written.getvalue()
    assert "stopped following job 7; the job goes on" in text
    assert "`gpumode job 7 --wait`" in text and "`gpumode cancel 7`" in text
