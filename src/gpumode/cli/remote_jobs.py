"""Remote verbs for switch jobs: ``switch`` (dry run, or a job, optionally followed live), ``jobs``, ``job``,
``cancel``.

Following a job polls ``GET /jobs/{id}``: on a terminal it is a live view with one progress bar per step; when
output is piped each step prints one line as it changes state, so logs read well too. ``switch --wait`` and
``job --wait`` exit 0 only when the job succeeded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.live import Live

from gpumode.cli import render
from gpumode.cli.client import EXIT_BAD_INPUT, EXIT_FAILED, Client, RemoteError
from gpumode.cli.remote import (
    MODES,
    ConfigOpt,
    JsonOpt,
    NodeOpt,
    ServerOpt,
    TokenOpt,
    check_choice,
    connect,
    fail,
    out,
    show,
)

JOB_STATES = ("queued", "running", "succeeded", "failed", "rolled_back", "cancelled")
POLL_S = 0.25


def switch(
    node: str = typer.Argument(..., help="The node to switch."),
    mode: str = typer.Option(..., "--mode", "-m", help="accel, vgpu or passthrough."),
    gpu: list[str] = typer.Option([], "--gpu", "-g", help="A GPU's PCI address (repeat; default: all)."),
    vgpu_type: str | None = typer.Option(None, "--vgpu-type", help="vGPU type: L40S-4Q, nvidia-1150, 1150."),
    count: int | None = typer.Option(None, "--count", min=1, help="vGPUs per GPU [default: as many as fit]."),
    profile: str | None = typer.Option(None, "--profile", help="A stored vGPU profile (type and count)."),
    alias: str | None = typer.Option(None, "--alias", help="Passthrough alias (stored on the server)."),
    vm_policy: str = typer.Option("gpu", "--vm-policy", help="all, gpu (VMs holding the GPUs) or refuse."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan and its impact; change nothing."),
    wait: bool = typer.Option(False, "--wait", "-w", help="Follow the job until it ends; exit 0 on success."),
    as_json: bool = JsonOpt,
    server: str | None = ServerOpt,
    token: str | None = TokenOpt,
    config: Path | None = ConfigOpt,
) -> None:
    """Switch a node (or some of its GPUs) to a mode: plan it on the server and queue a job for its agent."""
    check_choice(mode, MODES, "--mode")
    check_choice(vm_policy, ("all", "gpu", "refuse"), "--vm-policy")
    if mode != "vgpu" and (vgpu_type or count is not None or profile):
        raise fail("--vgpu-type, --count and --profile go with --mode vgpu", EXIT_BAD_INPUT)
    if profile and (vgpu_type or count is not None):
        raise fail("--profile names the type and count itself; drop --vgpu-type/--count", EXIT_BAD_INPUT)
    if alias and mode != "passthrough":
        raise fail("--alias goes with --mode passthrough", EXIT_BAD_INPUT)
    body: dict[str, Any] = {"mode": mode, "gpus": list(gpu), "vm_policy": vm_policy}
    for key, value in (("vgpu_type", vgpu_type), ("vgpu_count", count), ("profile", profile),
                       ("passthrough_alias", alias)):  # fmt: skip
        if value is not None:
            body[key] = value
    with connect(server, token, config) as client:
        if dry_run:
            data = client.request("POST", f"/nodes/{node}/switch", params={"dry_run": "true"}, json=body)
            show(data, as_json, render.plan_view(data["plan"]))
            return
        job = client.post(f"/nodes/{node}/switch", body)
        if not wait:
            if as_json:
                show(job, True)
            else:
                out().print(
                    f"job {job['id']} {job['state']} on {node}: {render.job_request_text(job)}, "
                    f"{len(job.get('steps') or [])} steps. Follow it: gpumode job {job['id']} --wait"
                )
            return
        final = follow(client, job["id"], out(), quiet=as_json)
    _finish(final, as_json)


def jobs(
    node: str | None = NodeOpt,
    state: str | None = typer.Option(None, "--state", help="queued, running, succeeded, failed, …"),
    limit: int = typer.Option(20, "--limit", min=1, max=1000, help="How many, newest first."),
    watch: bool = typer.Option(False, "--watch", help="Keep the list up to date (Ctrl-C to stop)."),
    until_idle: bool = typer.Option(False, "--until-idle", help="With --watch: stop when no job is active."),
    as_json: bool = JsonOpt,
    server: str | None = ServerOpt,
    token: str | None = TokenOpt,
    config: Path | None = ConfigOpt,
) -> None:
    """List switch jobs, newest first; --watch follows them."""
    check_choice(state, JOB_STATES, "--state")
    if until_idle and not watch:
        raise fail("--until-idle goes with --watch", EXIT_BAD_INPUT)
    if watch and as_json:
        raise fail("--watch shows a table; drop --json", EXIT_BAD_INPUT)
    with connect(server, token, config) as client:

        def fetch() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = client.get("/jobs", node=node, state=state, limit=limit)
            return found

        data = fetch()
        if not watch:
            show(data, as_json, render.jobs_table(data) if data else "no jobs")
            return
        _watch_list(fetch, data, until_idle)


def _watch_list(
    fetch: Callable[[], list[dict[str, Any]]], data: list[dict[str, Any]], until_idle: bool
) -> None:
    console = out()

    def idle(rows: list[dict[str, Any]]) -> bool:
        return until_idle and not any(j.get("state") in render.ACTIVE_JOB_STATES for j in rows)

    try:
        if console.is_terminal:
            with Live(render.jobs_table(data), console=console, refresh_per_second=4) as live:
                while not idle(data):
                    time.sleep(1.0)
                    data = fetch()
                    live.update(render.jobs_table(data))
            return
        # Piped: print the table when it changes, not every second.
        shown = None
        while True:
            key = [(j["id"], j.get("state"), render.step_counts(j)) for j in data]
            if key != shown:
                console.print(render.jobs_table(data) if data else "no jobs")
                shown = key
            if idle(data):
                return
            time.sleep(1.0)
            data = fetch()
    except KeyboardInterrupt:
        return


def job(
    job_id: int = typer.Argument(..., help="The job's id."),
    wait: bool = typer.Option(False, "--wait", "-w", help="Follow it until it ends; exit 0 on success."),
    as_json: bool = JsonOpt,
    server: str | None = ServerOpt,
    token: str | None = TokenOpt,
    config: Path | None = ConfigOpt,
) -> None:
    """Show one job: its request, each step's state and time, and its error."""
    with connect(server, token, config) as client:
        if wait:
            final = follow(client, job_id, out(), quiet=as_json)
        else:
            final = client.get(f"/jobs/{job_id}")
            show(final, as_json, render.job_progress(final))
            return
    _finish(final, as_json)


def cancel(
    job_id: int = typer.Argument(..., help="The job's id."),
    as_json: bool = JsonOpt,
    server: str | None = ServerOpt,
    token: str | None = TokenOpt,
    config: Path | None = ConfigOpt,
) -> None:
    """Cancel a job: a queued one ends at once; a running one stops at the next step and is rolled back."""
    with connect(server, token, config) as client:
        data = client.post(f"/jobs/{job_id}/cancel")
    if as_json:
        show(data, True)
    elif data.get("state") in render.ACTIVE_JOB_STATES:
        out().print(f"job {job_id}: cancel requested; the agent stops at the next step and rolls back")
    else:
        out().print(f"job {job_id}: {data.get('state')}")


# --- following a job ----------------------------------------------------------------------------------------


def follow(
    client: Client,
    job_id: int,
    console: Console,
    *,
    quiet: bool = False,
    poll_s: float = POLL_S,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Poll the job until it ends and return its last state; show it live (terminal) or line by line."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    job_now: dict[str, Any] = client.get(f"/jobs/{job_id}")
    if quiet:
        while job_now.get("state") in render.ACTIVE_JOB_STATES:
            _check_deadline(deadline, job_id)
            time.sleep(poll_s)
            job_now = client.get(f"/jobs/{job_id}")
        return job_now
    if console.is_terminal:
        window = max(5, console.height - 8)
        with Live(render.job_progress(job_now, window), console=console, refresh_per_second=8) as live:
            while job_now.get("state") in render.ACTIVE_JOB_STATES:
                _check_deadline(deadline, job_id)
                time.sleep(poll_s)
                job_now = client.get(f"/jobs/{job_id}")
                live.update(render.job_progress(job_now, window))
        return job_now
    console.print(f"job {job_id} on {job_now.get('node')}: {render.job_request_text(job_now)}")
    seen: dict[int, str] = {}
    state = None
    while True:
        for index, step in enumerate(job_now.get("steps") or []):
            if step.get("state", "pending") != "pending" and seen.get(index) != step.get("state"):
                seen[index] = step["state"]
                console.print(render.step_line(job_now, index))
        if job_now.get("state") != state:
            state = job_now.get("state")
            console.print(f"  job {job_id} {state}", style=render.JOB_STYLE.get(str(state), ""))
        if job_now.get("state") not in render.ACTIVE_JOB_STATES:
            return job_now
        _check_deadline(deadline, job_id)
        time.sleep(poll_s)
        job_now = client.get(f"/jobs/{job_id}")


def _check_deadline(deadline: float | None, job_id: int) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise RemoteError(f"job {job_id} did not end in time", EXIT_FAILED)


def _finish(final: dict[str, Any], as_json: bool) -> None:
    """Say how the job ended; exit non-zero unless it succeeded."""
    if as_json:
        show(final, True)
    else:
        state = final.get("state")
        line = f"job {final['id']} {state}"
        if final.get("error"):
            line += f": {final['error']}"
        out().print(line, style=render.JOB_STYLE.get(str(state), ""))
    if final.get("state") != "succeeded":
        raise typer.Exit(EXIT_FAILED)
