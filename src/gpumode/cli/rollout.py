"""Remote verbs for fleet rollouts: ``rollout start|show|cancel`` and ``rollouts``.

A rollout switches every node of a host group, ``--concurrency`` at a time, and starts no more once more than
``--failure-budget`` nodes failed (the server's ``POST /groups/{group}/switch``). Following one (``--wait``)
is :func:`gpumode.cli.remote_jobs.follow_until_over` with a view of the rollout: a live bar per node on a
terminal, a line per node whose state changed when piped; it exits 0 only when the rollout succeeded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer
from rich.console import RenderableType
from rich.text import Text

from gpumode.cli import render
from gpumode.cli.client import EXIT_FAILED, Client
from gpumode.cli.remote import LOCAL, JsonOpt, Remote, out, remote_verb, show
from gpumode.cli.remote_jobs import (
    AliasOpt,
    CountOpt,
    DryRunOpt,
    Followed,
    ModeOpt,
    ProfileOpt,
    VgpuTypeOpt,
    VmPolicyOpt,
    follow_until_over,
    switch_body,
)

WaitOpt = typer.Option(False, "--wait", "-w", help="Follow it until it ends; exit 0 if it succeeded.")
JOBS_PER_PAGE = 1000  # the API's largest page: the jobs of a rollout that size in one call

app = typer.Typer(help="Fleet rollouts: switch a host group, a few nodes at a time.", no_args_is_help=True)


@app.command("start")
@remote_verb
def start(
    group: str = typer.Argument(..., help="The host group to switch (see `gpumode nodes --group`)."),
    mode: str = ModeOpt,
    vgpu_type: str | None = VgpuTypeOpt,
    count: int | None = CountOpt,
    profile: str | None = ProfileOpt,
    alias: str | None = AliasOpt,
    vm_policy: str = VmPolicyOpt,
    concurrency: int = typer.Option(
        1, "--concurrency", "-c", min=1, max=1000, help="How many nodes switch at once."
    ),
    failure_budget: int = typer.Option(
        0, "--failure-budget", min=0, help="How many nodes may fail; one more and no new node starts."
    ),
    dry_run: bool = DryRunOpt,
    wait: bool = WaitOpt,
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """Switch every node of a host group to a mode: one job per node, N at once, within a failure budget."""
    body = switch_body(
        mode, vgpu_type=vgpu_type, count=count, profile=profile, alias=alias, vm_policy=vm_policy
    )
    body.update(concurrency=concurrency, max_failures=failure_budget)
    with remote.connect() as client:
        if dry_run:
            data = client.request("POST", f"/groups/{group}/switch", params={"dry_run": "true"}, json=body)
            show(data, as_json, render.rollout_plans_view(data))
            return
        rollout = client.post(f"/groups/{group}/switch", body)
        if not wait:
            if as_json:
                show(rollout, True)
            else:
                out().print(render.rollout_head(rollout))
                out().print(f"Follow it: gpumode rollout show {rollout['id']} --wait")
            return
        final = follow(client, rollout["id"], quiet=as_json)
    _finish(final, as_json)


@app.command("show")
@remote_verb
def show_rollout(
    rollout_id: int = typer.Argument(..., help="The rollout's id (see `gpumode rollouts`)."),
    wait: bool = WaitOpt,
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """Show a rollout: each node's state, its job's progress, and why a node failed or was skipped."""
    with remote.connect() as client:
        if wait:
            final = follow(client, rollout_id, quiet=as_json)
        else:
            now = _fetch(client, rollout_id)
            show(now.rollout, as_json, render.rollout_progress(now.rollout, now.jobs))
            return
    _finish(final, as_json)


@app.command("cancel")
@remote_verb
def cancel(
    rollout_id: int = typer.Argument(..., help="The rollout's id."),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """Cancel a rollout: it starts no more jobs and its queued ones are cancelled; running ones finish."""
    with remote.connect() as client:
        data = client.post(f"/rollouts/{rollout_id}/cancel")
    if as_json:
        show(data, True)
        return
    running = [f"{n['node']} (job {n['job']})" for n in data["nodes"] if n["state"] in ("queued", "running")]
    line = f"rollout {rollout_id} cancelled"
    if running:
        line += f"; still running: {', '.join(running)} (gpumode cancel JOB rolls one back)"
    out().print(line)


@remote_verb
def rollouts(
    limit: int = typer.Option(20, "--limit", min=1, max=1000, help="How many, newest first."),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """List rollouts, newest first: group, state, how many nodes are done, failures against the budget."""
    with remote.connect() as client:
        data = client.get("/rollouts", limit=limit)
    show(data, as_json, render.rollouts_table(data) if data else "no rollouts")


# --- following a rollout ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RolloutNow:
    rollout: dict[str, Any]
    jobs: dict[int, dict[str, Any]]  # its jobs by id, for their step progress


def _fetch(client: Client, rollout_id: int) -> RolloutNow:
    rollout: dict[str, Any] = client.get(f"/rollouts/{rollout_id}")
    found = client.get("/jobs", rollout=rollout_id, limit=JOBS_PER_PAGE)
    return RolloutNow(rollout, {j["id"]: j for j in found})


def follow(client: Client, rollout_id: int, *, quiet: bool = False) -> dict[str, Any]:
    """Poll the rollout until it ends; its last state."""
    seen: dict[str, tuple[str, Any]] = {}
    said: list[str] = []

    def changes(now: RolloutNow) -> list[RenderableType]:
        lines: list[RenderableType] = []
        if not said:
            request = render.job_request_text(now.rollout)
            lines.append(f"rollout {rollout_id} {now.rollout['group']}: {request}")
        for node in now.rollout["nodes"]:
            key = (node["state"], node.get("job"))
            if node["state"] != "pending" and seen.get(node["node"]) != key:
                seen[node["node"]] = key
                lines.append(_node_line(node))
        state = now.rollout["state"]
        if not said or said[-1] != state:
            said.append(state)
            ended, total = render.rollout_counts(now.rollout)
            lines.append(Text(f"  rollout {rollout_id} {state} ({ended}/{total} nodes)",
                              style=render.JOB_STYLE.get(state, "")))  # fmt: skip
        return lines

    followed: Followed[RolloutNow] = Followed(
        what=f"rollout {rollout_id}",
        fetch=lambda: _fetch(client, rollout_id),
        over=lambda now: now.rollout["state"] != "running",
        view=lambda now, window: render.rollout_progress(now.rollout, now.jobs, window),
        changes=changes,
    )
    return follow_until_over(followed, out(), quiet=quiet, poll_s=0.5).rollout


def _node_line(node: dict[str, Any]) -> Text:
    state = node["state"]
    line = Text(f"  {node['node']} ")
    line.append(state, style=render.JOB_STYLE.get(state, "red" if state == "blocked" else ""))
    if node.get("job") is not None:
        line.append(f" (job {node['job']})", style="dim")
    if node.get("error"):
        line.append(f"  {node['error']}", style="red")
    return line


def _finish(final: dict[str, Any], as_json: bool) -> None:
    """Say how the rollout ended; exit non-zero unless it succeeded."""
    if as_json:
        show(final, True)
    else:
        out().print(render.rollout_head(final))
        for node in final["nodes"]:
            if node["state"] not in ("succeeded", "pending"):
                out().print(_node_line(node))
    if final["state"] != "succeeded":
        raise typer.Exit(EXIT_FAILED)
