"""Remote verbs for switch jobs: ``switch`` (dry run, or a job, optionally followed live), ``jobs``, ``job``,
``cancel``.

Following a job polls ``GET /jobs/{id}``: on a terminal it is a live view with one progress bar per step; when
output is piped each step prints one line as it changes state, so logs read well too. ``switch --wait`` and
``job --wait`` exit 0 only when the job succeeded. :func:`follow_until_over` is that loop for anything that
ends (a job here, a rollout in :mod:`gpumode.cli.rollout`), and :func:`switch_body` with the ``*Opt``
options below is the switch request that ``switch`` and ``rollout start`` both send.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import typer
from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from gpumode.cli import render
from gpumode.cli.client import EXIT_BAD_INPUT, EXIT_FAILED, Client, RemoteError
from gpumode.cli.remote import (
    LOCAL,
    MODES,
    JsonOpt,
    NodeOpt,
    Remote,
    check_choice,
    fail,
    out,
    remote_verb,
    show,
)

EXIT_INTERRUPTED = 130  # 128 + SIGINT: the watching was interrupted, not the job
JOB_STATES = ("queued", "running", "succeeded", "failed", "rolled_back", "cancelled")
POLL_S = 0.25

# The switch request's options, shared by `switch` and `rollout start` (both send a SwitchIn).
ModeOpt = typer.Option(..., "--mode", "-m", help="accel, vgpu or passthrough.")
VgpuTypeOpt = typer.Option(None, "--vgpu-type", help="vGPU type: L40S-4Q, nvidia-1150, 1150.")
CountOpt = typer.Option(None, "--count", min=1, help="vGPUs per GPU \\[default: as many as fit].")
ProfileOpt = typer.Option(None, "--profile", help="A stored vGPU profile (type and count).")
AliasOpt = typer.Option(None, "--alias", help="Passthrough alias (stored on the server).")
VmPolicyOpt = typer.Option("gpu", "--vm-policy", help="all, gpu (VMs holding the GPUs) or refuse.")
DryRunOpt = typer.Option(False, "--dry-run", help="Show the plan and its impact; change nothing.")


def switch_body(
    mode: str,
    *,
    gpus: list[str] | None = None,
    vgpu_type: str | None = None,
    count: int | None = None,
    profile: str | None = None,
    alias: str | None = None,
    vm_policy: str = "gpu",
) -> dict[str, Any]:
    """The API's switch request from the options; combinations the server would refuse are refused here,
    with the option names the user typed."""
    check_choice(mode, MODES, "--mode")
    check_choice(vm_policy, ("all", "gpu", "refuse"), "--vm-policy")
    if mode != "vgpu" and (vgpu_type or count is not None or profile):
        raise fail("--vgpu-type, --count and --profile go with --mode vgpu", EXIT_BAD_INPUT)
    if profile and (vgpu_type or count is not None):
        raise fail("--profile names the type and count itself; drop --vgpu-type/--count", EXIT_BAD_INPUT)
    if alias and mode != "passthrough":
        raise fail("--alias goes with --mode passthrough", EXIT_BAD_INPUT)
    body: dict[str, Any] = {"mode": mode, "gpus": list(gpus or []), "vm_policy": vm_policy}
    for key, value in (("vgpu_type", vgpu_type), ("vgpu_count", count), ("profile", profile),
                       ("passthrough_alias", alias)):  # fmt: skip
        if value is not None:
            body[key] = value
    return body


@remote_verb
def switch(
    node: str = typer.Argument(..., help="The node to switch."),
    mode: str = ModeOpt,
    gpu: list[str] = typer.Option([], "--gpu", "-g", help="A GPU's PCI address (repeat; default: all)."),
    vgpu_type: str | None = VgpuTypeOpt,
    count: int | None = CountOpt,
    profile: str | None = ProfileOpt,
    alias: str | None = AliasOpt,
    vm_policy: str = VmPolicyOpt,
    dry_run: bool = DryRunOpt,
    wait: bool = typer.Option(False, "--wait", "-w", help="Follow the job until it ends; exit 0 on success."),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """Switch a node (or some of its GPUs) to a mode: plan it on the server and queue a job for its agent."""
    body = switch_body(
        mode, gpus=gpu, vgpu_type=vgpu_type, count=count, profile=profile, alias=alias, vm_policy=vm_policy
    )
    with remote.connect() as client:
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


@remote_verb
def jobs(
    node: str | None = NodeOpt,
    state: str | None = typer.Option(None, "--state", help="queued, running, succeeded, failed, …"),
    limit: int = typer.Option(20, "--limit", min=1, max=1000, help="How many, newest first."),
    watch: bool = typer.Option(False, "--watch", help="Keep the list up to date (Ctrl-C to stop)."),
    until_idle: bool = typer.Option(False, "--until-idle", help="With --watch: stop when no job is active."),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """List switch jobs, newest first; --watch follows them."""
    check_choice(state, JOB_STATES, "--state")
    if until_idle and not watch:
        raise fail("--until-idle goes with --watch", EXIT_BAD_INPUT)
    if watch and as_json:
        raise fail("--watch shows a table; drop --json", EXIT_BAD_INPUT)
    with remote.connect() as client:

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


@remote_verb
def job(
    job_id: int = typer.Argument(..., help="The job's id."),
    wait: bool = typer.Option(False, "--wait", "-w", help="Follow it until it ends; exit 0 on success."),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """Show one job: its request, each step's state and time, and its error."""
    with remote.connect() as client:
        if wait:
            final = follow(client, job_id, out(), quiet=as_json)
        else:
            final = client.get(f"/jobs/{job_id}")
            show(final, as_json, render.job_progress(final))
            return
    _finish(final, as_json)


@remote_verb
def cancel(
    job_id: int = typer.Argument(..., help="The job's id."),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """Cancel a job: a queued one ends at once; a running one stops at the next step and is rolled back."""
    with remote.connect() as client:
        data = client.post(f"/jobs/{job_id}/cancel")
    if as_json:
        show(data, True)
    elif data.get("state") in render.ACTIVE_JOB_STATES:
        out().print(f"job {job_id}: cancel requested; the agent stops at the next step and rolls back")
    else:
        out().print(f"job {job_id}: {data.get('state')}")


# --- following a job ----------------------------------------------------------------------------------------

T = TypeVar("T")


@dataclass
class Followed(Generic[T]):
    """Something that runs on the server until it is over, and how to show it while it does.

    ``view`` is the live view for a terminal (given how many rows fit); ``changes`` the lines to print, when
    output is piped, about what changed since it was last called (it keeps what it has seen).
    """

    what: str  # "job 12", for the timeout message
    fetch: Callable[[], T]
    over: Callable[[T], bool]
    view: Callable[[T, int], RenderableType]
    changes: Callable[[T], list[RenderableType]]


def follow_until_over(
    followed: Followed[T],
    console: Console,
    *,
    quiet: bool = False,
    poll_s: float = POLL_S,
    timeout_s: float | None = None,
) -> T:
    """Poll until ``followed`` is over and return its last state: a live view on a terminal, lines when
    piped, nothing with ``quiet`` (``--json`` prints the end state alone)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def next_state() -> T:
        if deadline is not None and time.monotonic() > deadline:
            raise RemoteError(f"{followed.what} did not end in time", EXIT_FAILED)
        time.sleep(poll_s)
        return followed.fetch()

    now = followed.fetch()
    if quiet:
        while not followed.over(now):
            now = next_state()
        return now
    if console.is_terminal:
        window = max(5, console.height - 8)
        with Live(followed.view(now, window), console=console, refresh_per_second=8) as live:
            while not followed.over(now):
                now = next_state()
                live.update(followed.view(now, window))
        return now
    while True:
        for line in followed.changes(now):
            console.print(line)
        if followed.over(now):
            return now
        now = next_state()


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
    seen: dict[int, str] = {}
    said: list[str | None] = []  # the job states printed so far; empty: not even the header yet

    def fetch() -> dict[str, Any]:
        found: dict[str, Any] = client.get(f"/jobs/{job_id}")
        return found

    def changes(job_now: dict[str, Any]) -> list[RenderableType]:
        lines: list[RenderableType] = []
        if not said:
            lines.append(f"job {job_id} on {job_now.get('node')}: {render.job_request_text(job_now)}")
            said.append(None)
        for index, step in enumerate(job_now.get("steps") or []):
            if step.get("state", "pending") != "pending" and seen.get(index) != step.get("state"):
                seen[index] = step["state"]
                lines.append(render.step_line(job_now, index))
        state = job_now.get("state")
        if state != said[-1]:
            said.append(state)
            lines.append(Text(f"  job {job_id} {state}", style=render.JOB_STYLE.get(str(state), "")))
        return lines

    followed = Followed(
        what=f"job {job_id}",
        fetch=fetch,
        over=lambda j: j.get("state") not in render.ACTIVE_JOB_STATES,
        view=render.job_progress,
        changes=changes,
    )
    try:
        return follow_until_over(followed, console, quiet=quiet, poll_s=poll_s, timeout_s=timeout_s)
    except KeyboardInterrupt:
        # Ctrl-C stops the watching, not the job: the agent runs it whether anyone follows or not
        console.print(
            f"stopped following job {job_id}; the job goes on. Follow it again: "
            f"`gpumode job {job_id} --wait`; stop it: `gpumode cancel {job_id}`",
            highlight=False,
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None


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
