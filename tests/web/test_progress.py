"""The job page's overall progress: steps behind the job, and the one running."""

from __future__ import annotations

from gpumode.server.web.progress import step_progress


def test_progress_counts_done_and_skipped_and_names_the_running_step() -> None:
    steps = [
        {"id": "s1", "state": "done"},
        {"id": "s2", "state": "skipped"},
        {"id": "s3", "state": "running"},
        {"id": "s4", "state": "pending"},
    ]
    assert step_progress(steps) == {"finished": 2, "total": 4, "percent": 50, "current": "s3"}
    steps[2]["state"] = "failed"
    assert step_progress(steps)["current"] is None and step_progress(steps)["finished"] == 2
    assert step_progress([]) == {"finished": 0, "total": 0, "percent": 100, "current": None}
    assert step_progress([{"id": "a", "state": "done"}] * 3)["percent"] == 100
