"""The Rich views of jobs and plans: what a terminal shows while a long job runs."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from gpumode.cli import render


def _text(renderable: Any, width: int = 140) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)
    console.print(renderable)
    out: str = console.file.getvalue()  # type: ignore[attr-defined]
    return out


def _job(states: list[str], error: str | None = None) -> dict[str, Any]:
    steps = [
        {"id": f"{n:02d}-vgpu.create", "action": "vgpu.create", "target": f"gpu{n}", "where": "host",
         "state": st, "started_at": "2025-01-01T00:00:00+00:00" if st != "pending" else None,
         "finished_at": "2025-01-01T00:00:01.500000+00:00" if st in ("done", "failed") else None,
         "error": "EBUSY" if st == "failed" else None}
        for n, st in enumerate(states, 1)
    ]  # fmt: skip
    return {"id": 9, "node": "n1", "state": "running", "error": error, "steps": steps,
            "request": {"mode": "vgpu", "vgpu_type": "L40S-4Q", "vgpu_count": 2, "gpus": []},
            "plan": {"steps": [{"id": s["id"], "estimate_s": 2.0} for s in steps]}}  # fmt: skip


def test_job_progress_shows_every_step_and_counts() -> None:
    text = _text(render.job_progress(_job(["done", "skipped", "running", "pending"])))
    assert "job 9 n1: vgpu L40S-4Q x2 (all GPUs) — running  2/4 steps" in text
    assert "1/4" in text and "4/4" in text
    assert "1.50s" in text  # a finished step's time


def test_job_progress_window_keeps_the_current_step_in_view() -> None:
    states = ["done"] * 30 + ["running"] + ["pending"] * 19
    text = _text(render.job_progress(_job(states), window=8))
    rows = [line.split()[0] for line in text.splitlines()[2:] if line.split() and "/50" in line.split()[0]]
    assert rows == [f"{n}/50" for n in range(27, 35)]  # the running step (31) with a few on each side
    assert "… 26 earlier step(s)" in text and "… 16 more step(s)" in text


def test_job_progress_shows_failures() -> None:
    text = _text(render.job_progress(_job(["done", "failed"], error="step 2 failed")))
    assert "failed" in text and "EBUSY" in text and "error: step 2 failed" in text


def test_step_line_and_jobs_table() -> None:
    job = _job(["done", "failed"])
    assert _text(render.step_line(job, 0)).strip() == "✔ 1/2 vgpu.create gpu1  done 1.50s"
    assert "✘ 2/2 vgpu.create gpu2  failed 1.50s  EBUSY" in _text(render.step_line(job, 1))
    table = _text(render.jobs_table([{**job, "cancel_requested": True, "created_at": None}]))
    assert "running (cancelling)" in table and "2/2" in table


def test_plan_summary_groups_steps_by_action() -> None:
    plan = {
        "hostname": "h", "request": {"mode": "vgpu"},
        "steps": [{"action": "vm.shutdown", "target": "vm1", "where": "host"}]
        + [{"action": "vgpu.create", "target": f"0000:0{n}:00.0", "where": "host"} for n in range(5)]
        + [{"action": "cloud.register_cards", "target": "h", "where": "cloud"}],
        "impact": {"gpus": {"0000:01:00.0": ["accel", "vgpu"]}, "vms_stopped": ["vm1"],
                   "driver_change": True},
    }  # fmt: skip
    text = _text(render.plan_summary(plan))
    assert "plan for h: vgpu (7 steps)" in text
    assert "vgpu.create" in text and "… (+2)" in text and "│     5 │" in text
    assert "accel → vgpu" in text and "VMs stopped" in text and "vm1" in text


def test_ago_and_empty_values() -> None:
    assert render.ago(None) == "-"
    assert render.ago("not a time") == "not a time"
    assert render.styled(None, render.MODE_STYLE).plain == "-"
