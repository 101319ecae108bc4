"""The Rich views of jobs, rollouts and plans, and the loop that follows them: what a terminal shows while a
long job runs."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from gpumode.cli import render
from gpumode.cli.client import RemoteError
from gpumode.cli.remote_jobs import Followed, follow_until_over


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


def test_job_progress_says_what_the_cloud_platform_did() -> None:
    hold = {"node": "n1", "service_id": "s1", "disabled_by_us": True, "reason": "gpumode job 9",
            "moved": [{"id": "vm-1"}, {"id": "vm-2"}]}  # fmt: skip
    held = _text(render.job_progress({**_job(["running"]), "cloud": {"hold": hold, "released": False}}))
    assert "cloud: compute service disabled by gpumode; 2 instance(s) moved off; node held out of" in held
    ended = {"hold": hold, "released": True, "problems": ["vm-2 did not start again"]}
    assert render.cloud_text(ended).endswith("node given back; not undone: vm-2 did not start again")
    waiting = render.cloud_text({"waiting_since": "2025-01-01T00:00:00+00:00"})
    assert waiting.startswith("waiting for the cloud platform since ")
    assert render.cloud_text(None) == "" and "cloud:" not in _text(render.job_progress(_job(["done"])))


def test_rollout_progress_keeps_the_first_node_not_over_in_view() -> None:
    nodes = [{"node": f"n{i:02d}", "job": i, "state": "succeeded", "error": None} for i in range(1, 12)]
    nodes.append({"node": "n12", "job": 12, "state": "running", "error": None})
    nodes.append({"node": "n13", "job": None, "state": "blocked", "error": "n13 has another active job"})
    nodes += [{"node": f"n{i:02d}", "job": None, "state": "pending", "error": None} for i in range(14, 21)]
    rollout = {"id": 3, "group": "edge", "state": "running", "request": {"mode": "accel"}, "concurrency": 1,
               "max_failures": 1, "failures": 1, "nodes": nodes}  # fmt: skip
    jobs = {12: {**_job(["done", "running", "pending"]), "id": 12}}
    text = _text(render.rollout_progress(rollout, jobs, window=6))
    assert "rollout 3 edge: accel (all GPUs) — running  12/20 nodes, 1 failure(s) of 1 allowed" in text
    rows = [line.split()[0] for line in text.splitlines() if line.strip().startswith("n")]
    assert rows == ["n09", "n10", "n11", "n12", "n13", "n14"]  # n12 (the first not over) near the middle
    assert "… 8 earlier node(s)" in text and "… 6 more node(s)" in text
    n12 = next(line for line in text.splitlines() if line.strip().startswith("n12"))
    assert "job 12" in n12 and "1/3" in n12 and "vgpu.create gpu2" in n12
    assert "n13 has another active job" in text



def _followed(states: list[str]) -> Followed[dict[str, Any]]:
    """A job that goes through ``states``, one per poll, told line by line when piped."""
    seen = iter(states)
    return Followed(
        what="job 9",
        fetch=lambda: {**_job(["done"]), "state": next(seen)},
        over=lambda job: job["state"] not in render.ACTIVE_JOB_STATES,
        view=render.job_progress,
        changes=lambda job: [f"now {job['state']}"],
    )


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    written = io.StringIO()
    return Console(file=written, width=120, force_terminal=terminal, color_system=None), written


def test_follow_until_over_live_piped_and_quiet() -> None:
    terminal, shown = _console(True)
    last = follow_until_over(_followed(["queued", "running", "succeeded"]), terminal, poll_s=0)
    assert last["state"] == "succeeded"
    assert "job 9 n1: vgpu L40S-4Q x2 (all GPUs) — succeeded" in shown.getvalue()  # the last live frame

    piped, lines = _console(False)
    follow_until_over(_followed(["queued", "running", "failed"]), piped, poll_s=0)
    assert lines.getvalue().splitlines() == ["now queued", "now running", "now failed"]

    quiet, nothing = _console(False)
    last = follow_until_over(_followed(["running", "cancelled"]), quiet, quiet=True, poll_s=0)
    assert last["state"] == "cancelled" and nothing.getvalue() == ""
    with pytest.raises(RemoteError, match="job 9 did not end in time"):
        follow_until_over(_followed(["running"] * 100), quiet, quiet=True, poll_s=0.01, timeout_s=0)
