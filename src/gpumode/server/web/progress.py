"""A job's overall progress, for the job page's bar: how many steps are behind it, and which one runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FINISHED = frozenset({"done", "skipped"})  # a step the job has moved past


def step_progress(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``finished`` of ``total`` steps, a whole ``percent``, and the id of the ``current`` (running) step."""
    total = len(steps)
    finished = sum(1 for s in steps if s.get("state") in FINISHED)
    current = next((s["id"] for s in steps if s.get("state") == "running"), None)
    percent = 100 if total == 0 else finished * 100 // total
    return {"finished": finished, "total": total, "percent": percent, "current": current}
