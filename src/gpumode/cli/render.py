"""Rich views of the API's JSON: one function per kind of thing, shared by the remote verbs and the demo.

They take the server's JSON as it comes (dicts), so a field the server adds later never breaks a table, and
they return renderables rather than printing, so the demo can frame them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

MODE_STYLE = {
    "accel": "green",
    "vgpu": "magenta",
    "passthrough": "cyan",
    "none": "dim",
    "mixed": "yellow",
    "unknown": "red",
}
STATUS_STYLE = {"free": "green", "in_use": "cyan", "reserved": "yellow", "lost": "bold red"}
SEVERITY_STYLE = {"info": "", "warning": "yellow", "critical": "bold red"}
JOB_STYLE = {
    "pending": "dim", "queued": "dim", "running": "cyan", "succeeded": "green", "done": "green",
    "failed": "bold red", "cancelled": "yellow", "canceled": "yellow",
    "rolled_back": "yellow", "skipped": "dim", "undoing": "yellow", "undone": "yellow",
}  # fmt: skip

Row = Mapping[str, Any]


def styled(value: Any, styles: Mapping[str, str]) -> Text:
    text = "-" if value is None else str(value)
    return Text(text, style=styles.get(text, ""))


def ago(stamp: str | None, now: datetime | None = None) -> str:
    """``12s ago`` from an ISO timestamp; ``-`` when there is none (never seen by this server process)."""
    if not stamp:
        return "-"
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    seconds = max(0, int(((now or datetime.now(UTC)) - when).total_seconds()))
    if seconds < 120:
        return f"{seconds}s ago"
    if seconds < 7200:
        return f"{seconds // 60}m ago"
    if seconds < 172800:
        return f"{seconds // 3600}h ago"
    return f"{seconds // 86400}d ago"


def clock(stamp: str | None) -> str:
    """``HH:MM:SS`` of an ISO timestamp (local time), for event and job lists."""
    if not stamp:
        return "-"
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _table(title: str | None, *columns: str, right: Iterable[str] = ()) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    keep_right = set(right)
    for column in columns:
        table.add_column(column, justify="right" if column in keep_right else "left")
    return table


def nodes_table(nodes: Sequence[Row], title: str | None = "nodes") -> Table:
    table = _table(title, "node", "group", "mode", "driver", "GPUs", "agent", "last seen", right=("GPUs",))
    for n in nodes:
        table.add_row(
            n["name"],
            n.get("group") or "-",
            styled(n.get("mode"), MODE_STYLE),
            n.get("driver_state") or "-",
            str(n.get("gpu_count", "-")),
            _agent(n),
            ago(n.get("last_seen")),
        )
    return table


def _agent(node: Row) -> str:
    """The agent's version, marked when it speaks an older protocol than the server."""
    if node.get("agent_protocol") is None:
        return "-"
    version = node.get("agent_version") or "0.1.0"
    return f"[yellow]{version} (out of date)[/]" if node.get("agent_out_of_date") else version


def gpus_table(details: Sequence[Row], title: str | None = "GPUs") -> Table:
    """One row per GPU of each node detail (``GET /nodes/{name}``)."""
    table = _table(title, "node", "GPU", "model", "mode", "driver", "vGPUs", "companions", right=("vGPUs",))
    for node in details:
        for g in node.get("gpus", []):
            vgpus = len(g.get("vgpus") or []) or len(g.get("mdevs") or [])
            table.add_row(
                node["name"],
                g["address"],
                g.get("name") or g.get("device", "-"),
                styled(g.get("mode"), MODE_STYLE),
                g.get("driver") or "-",
                str(vgpus) if vgpus else "-",
                ", ".join(g.get("companions") or []) or "-",
            )
    return table


def cards_table(cards: Sequence[Row], title: str | None = "cards") -> Table:
    columns = ("id", "node", "kind", "GPU", "device", "vGPU type", "status", "holder")
    table = _table(title, *columns, right=("id",))
    for c in cards:
        table.add_row(
            str(c["id"]),
            c["node"],
            styled(c.get("kind"), MODE_STYLE),
            c.get("gpu") or "-",
            c.get("device") or "-",
            c.get("vgpu_type") or "-",
            styled(c.get("status"), STATUS_STYLE),
            c.get("holder") or "-",
        )
    return table


def card_summary(cards: Sequence[Row]) -> Text:
    """``hgx-h100-01: 8 accel (8 free)`` per node and kind, in one line each."""
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for c in cards:
        per = counts.setdefault((c["node"], c["kind"]), {})
        per[c["status"]] = per.get(c["status"], 0) + 1
    text = Text()
    for (node, kind), per in sorted(counts.items()):
        total = sum(per.values())
        parts = ", ".join(f"{n} {s}" for s, n in sorted(per.items()))
        text.append(f"{node}: ", style="bold")
        text.append(f"{total} {kind}", style=MODE_STYLE.get(kind, ""))
        text.append(f" ({parts})\n")
    return text


def whitelist_view(doc: Row) -> Table:
    table = _table("enabled modes", "level", "name", "modes")
    table.add_row("platform", "-", ", ".join(doc.get("platform", [])) or "(none)")
    for name, modes in sorted(doc.get("groups", {}).items()):
        table.add_row("group", name, ", ".join(modes) or "(none)")
    for name, modes in sorted(doc.get("models", {}).items()):
        table.add_row("model", name, ", ".join(modes) or "(none)")
    return table


def events_table(events: Sequence[Row], title: str | None = "events") -> Table:
    table = _table(title, "id", "time", "node", "severity", "kind", "message", right=("id",))
    for e in events:
        table.add_row(
            str(e["id"]),
            clock(e.get("created_at")),
            e.get("node") or "-",
            styled(e.get("severity"), SEVERITY_STYLE),
            e.get("kind", "-"),
            Text(e.get("message", "")),
        )
    return table


def tokens_table(tokens: Sequence[Row], title: str | None = "tokens") -> Table:
    table = _table(title, "id", "name", "role", "node", "revoked", "created", right=("id",))
    for t in tokens:
        table.add_row(
            str(t["id"]),
            t["name"],
            t.get("role", "-"),
            t.get("node") or "-",
            "yes" if t.get("revoked") else "no",
            clock(t.get("created_at")),
        )
    return table


def join_tokens_table(tokens: Sequence[Row], title: str | None = "join tokens") -> Table:
    table = _table(title, "id", "name", "uses left", "expires", "revoked", "created", right=("id",))
    for t in tokens:
        made_for = t.get("uses")
        table.add_row(
            str(t["id"]),
            t["name"],
            f"{t.get('uses_left')} of {made_for}" if made_for is not None else str(t.get("uses_left")),
            clock(t.get("expires_at")) if t.get("expires_at") else "-",
            "yes" if t.get("revoked") else "no",
            clock(t.get("created_at")),
        )
    return table


# --- plans and jobs -----------------------------------------------------------------------------------------


def plan_view(plan: Row) -> RenderableType:
    """Steps and impact of a plan in its JSON form (``Plan.to_dict()``)."""
    request = plan.get("request", {})
    steps = _table(
        f"plan for {plan.get('hostname', '?')}: {request.get('mode', '?')}",
        "#", "action", "target", "what", "where", "est.", right=("#", "est."),
    )  # fmt: skip
    for n, step in enumerate(plan.get("steps", []), 1):
        steps.add_row(
            str(n),
            step.get("action", ""),
            step.get("target", ""),
            step.get("description", ""),
            step.get("where", "host"),
            f"{step.get('estimate_s', 0):g}s",
            style="dim" if step.get("where", "host") != "host" else "",
        )
    return Group(steps, impact_view(plan.get("impact", {})))


def impact_view(impact: Row) -> Table:
    table = Table(title="impact", title_justify="left", title_style="bold", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for address, change in sorted(impact.get("gpus", {}).items()):
        now, after = change
        table.add_row(f"GPU {address}", f"{now} → {after}")
    labels = (
        ("vms_stopped", "VMs stopped"),
        ("vms_restarted", "VMs started again"),
        ("vms_left_stopped", "VMs left stopped"),
        ("devices_detached", "devices detached"),
        ("vgpus_reclaimed", "vGPUs reclaimed"),
        ("modules_unloaded", "modules unloaded"),
        ("modules_loaded", "modules loaded"),
        ("packages_removed", "packages removed"),
        ("packages_installed", "packages installed"),
    )
    for key, label in labels:
        values = impact.get(key) or []
        if values:
            table.add_row(label, Text(", ".join(values)))
    table.add_row("driver change", "yes" if impact.get("driver_change") else "no")
    table.add_row("reboot required", Text("yes", style="bold red") if impact.get("reboot_required") else "no")
    table.add_row("estimated time", f"{impact.get('estimated_seconds', 0):g} s")
    for note in impact.get("notes") or []:
        table.add_row("note", Text(str(note), style="yellow"))
    return table


ACTIVE_JOB_STATES = frozenset({"queued", "running"})
FINISHED_STEP_STATES = frozenset({"done", "skipped", "failed", "undone"})


def job_request_text(job: Row) -> str:
    """``vgpu NVIDIA L40S-4Q x2 on 2 GPUs (vm policy gpu)`` from a job's request."""
    req = job.get("request") or {}
    text = str(req.get("mode", "?"))
    if req.get("vgpu_type"):
        text += f" {req['vgpu_type']}"
        if req.get("vgpu_count"):
            text += f" x{req['vgpu_count']}"
    if req.get("passthrough_alias"):
        text += f" alias {req['passthrough_alias']}"
    gpus = req.get("gpus") or []
    text += f" on {len(gpus)} GPU(s)" if gpus else " (all GPUs)"
    return text


def step_counts(job: Row) -> tuple[int, int]:
    steps = job.get("steps") or []
    return sum(s.get("state") in FINISHED_STEP_STATES for s in steps), len(steps)


def jobs_table(jobs: Sequence[Row], title: str | None = "jobs") -> Table:
    columns = ("id", "node", "state", "request", "steps", "by", "created", "error")
    table = _table(title, *columns, right=("id", "steps"))
    for j in jobs:
        finished, total = step_counts(j)
        state = j.get("state", "?") + (" (cancelling)" if j.get("cancel_requested") and
                                       j.get("state") in ACTIVE_JOB_STATES else "")  # fmt: skip
        table.add_row(
            str(j["id"]),
            j.get("node", "-"),
            Text(state, style=JOB_STYLE.get(j.get("state", ""), "")),
            job_request_text(j),
            f"{finished}/{total}",
            j.get("created_by") or "-",
            clock(j.get("created_at")),
            Text(j.get("error") or ""),
        )
    return table


def step_seconds(step: Row, now: datetime | None = None) -> float | None:
    """How long a step ran (or has been running); ``None`` before it started."""
    start = _parse(step.get("started_at"))
    if start is None:
        return None
    end = _parse(step.get("finished_at")) or now or datetime.now(UTC)
    return max(0.0, (end - start).total_seconds())


def _parse(stamp: Any) -> datetime | None:
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def job_progress(job: Row, window: int | None = None) -> RenderableType:
    """A job with an overall bar and one progress bar per step: full when done, filling while it runs (by
    its estimate), red when it failed. With ``window``, only that many step rows around the current one are
    shown (a vGPU switch of an 8-GPU host has ~50 steps; a terminal has fewer lines)."""
    from rich.progress_bar import ProgressBar

    finished, total = step_counts(job)
    state = job.get("state", "?")
    head = Text.assemble(
        (f"job {job['id']} ", "bold"),
        (f"{job.get('node', '?')}: {job_request_text(job)} — ", ""),
        (state, JOB_STYLE.get(state, "")),
        (f"  {finished}/{total} steps", "dim"),
    )
    overall = Table.grid()  # a bar alone does not end its line; in a grid it does
    overall.add_row(ProgressBar(total=max(total, 1), completed=finished, width=60))
    all_steps = list(enumerate(job.get("steps") or [], 1))
    shown = all_steps
    if window is not None and len(all_steps) > window:
        current = next(
            (n for n, s in all_steps if s.get("state") not in FINISHED_STEP_STATES), len(all_steps)
        )
        start = max(0, min(current - 1 - window // 2, len(all_steps) - window))
        shown = all_steps[start : start + window]
    table = Table(box=None, show_header=False, padding=(0, 1))
    table.add_column(justify="right")
    table.add_column(width=24)
    table.add_column()
    table.add_column()
    table.add_column(justify="right")
    estimates = {s.get("id"): s.get("estimate_s", 1.0) for s in (job.get("plan") or {}).get("steps", [])}
    if shown and shown[0][0] > 1:
        table.add_row("", "", "", Text(f"… {shown[0][0] - 1} earlier step(s)", style="dim"), "")
    for n, step in shown:
        st = step.get("state", "pending")
        seconds = step_seconds(step)
        if st in ("done", "skipped"):
            bar = ProgressBar(total=1, completed=1, width=24, finished_style="green")
        elif st == "running":
            estimate = float(estimates.get(step.get("id"), 1.0) or 1.0)
            done = min((seconds or 0.0) / estimate, 0.95)
            bar = ProgressBar(total=1, completed=done, width=24, pulse=done >= 0.95, complete_style="cyan")
        elif st == "failed":
            bar = ProgressBar(total=1, completed=1, width=24, finished_style="red")
        elif st == "undone":
            bar = ProgressBar(total=1, completed=1, width=24, finished_style="yellow")
        else:
            bar = ProgressBar(total=1, completed=0, width=24)
        what = Text(f"{step.get('action', '')} {step.get('target', '')}")
        if step.get("where") == "cloud":
            what.append("  (cloud)", style="dim")
        if step.get("error"):
            what.append(f"\n  {step['error']}", style="red")
        table.add_row(
            f"{n}/{total}",
            bar,
            Text(st, style=JOB_STYLE.get(st, "")),
            what,
            f"{seconds:.2f}s" if seconds is not None else "",
        )
    if shown and shown[-1][0] < total:
        table.add_row("", "", "", Text(f"… {total - shown[-1][0]} more step(s)", style="dim"), "")
    parts: list[RenderableType] = [head, overall, table]
    cloud = cloud_text(job.get("cloud"))
    if cloud:
        parts.append(Text(f"cloud: {cloud}", style="dim"))
    if job.get("error"):
        parts.append(Text(f"error: {job['error']}", style="red"))
    return Group(*parts)


def cloud_text(record: Row | None) -> str:
    """What the cloud platform did around a job (``Job.cloud``), in words; empty when it did nothing.

    The hold's content is the platform's own: the OpenStack keys (a disabled nova-compute service, moved
    instances) are named when present, anything else is left to ``--json``.
    """
    if not record:
        return ""
    if "waiting_since" in record:
        return f"waiting for the cloud platform since {clock(record['waiting_since'])}"
    if "taking" in record:
        return "taking the node out of the cloud's scheduling"
    if "hold" not in record:
        return ""
    hold = record.get("hold") or {}
    parts = []
    if hold.get("disabled_by_us"):
        parts.append("compute service disabled by gpumode")
    if hold.get("moved"):
        parts.append(f"{len(hold['moved'])} instance(s) moved off")
    parts.append("node given back" if record.get("released") else "node held out of scheduling")
    parts.extend(f"not undone: {p}" for p in record.get("problems") or [])
    return "; ".join(parts)


# --- rollouts -----------------------------------------------------------------------------------------------

ROLLOUT_NODE_ENDED = frozenset({"succeeded", "failed", "rolled_back", "cancelled", "blocked"})


def rollout_counts(rollout: Row) -> tuple[int, int]:
    """(nodes whose part is over, nodes); a node never started because the rollout stopped is not over."""
    nodes = rollout.get("nodes") or []
    return sum(n.get("state") in ROLLOUT_NODE_ENDED for n in nodes), len(nodes)


def rollout_head(rollout: Row) -> Text:
    """``rollout 3 edge: passthrough (all GPUs) — running  1/4 nodes, 0 failure(s) of 1 allowed``."""
    ended, total = rollout_counts(rollout)
    state = rollout.get("state", "?")
    return Text.assemble(
        (f"rollout {rollout['id']} ", "bold"),
        (f"{rollout.get('group', '?')}: {job_request_text(rollout)} — ", ""),
        (state, JOB_STYLE.get(state, "")),
        (f"  {ended}/{total} nodes, {rollout.get('failures', 0)} failure(s) of "
         f"{rollout.get('max_failures', 0)} allowed, {rollout.get('concurrency', 1)} at once", "dim"),
    )  # fmt: skip


def rollouts_table(rollouts: Sequence[Row], title: str | None = "rollouts") -> Table:
    columns = ("id", "group", "state", "request", "nodes", "failures", "by", "created")
    table = _table(title, *columns, right=("id", "nodes", "failures"))
    for r in rollouts:
        ended, total = rollout_counts(r)
        table.add_row(
            str(r["id"]),
            r.get("group", "-"),
            Text(r.get("state", "?"), style=JOB_STYLE.get(r.get("state", ""), "")),
            job_request_text(r),
            f"{ended}/{total}",
            f"{r.get('failures', 0)}/{r.get('max_failures', 0)}",
            r.get("created_by") or "-",
            clock(r.get("created_at")),
        )
    return table


def rollout_progress(rollout: Row, jobs: Mapping[int, Row], window: int | None = None) -> RenderableType:
    """A rollout with an overall bar (nodes over) and a row per node: its job's step bar, state, and what it
    is doing or why it failed. ``jobs`` are the rollout's jobs by id (``GET /jobs?rollout=ID``); with
    ``window``, only that many node rows around the first one not over are shown."""
    from rich.progress_bar import ProgressBar

    ended, total = rollout_counts(rollout)
    overall = Table.grid()
    overall.add_row(ProgressBar(total=max(total, 1), completed=ended, width=60))
    nodes = list(enumerate(rollout.get("nodes") or [], 1))
    shown = nodes
    if window is not None and len(nodes) > window:
        current = next((i for i, n in nodes if n.get("state") not in ROLLOUT_NODE_ENDED), len(nodes))
        start = max(0, min(current - 1 - window // 2, len(nodes) - window))
        shown = nodes[start : start + window]
    table = Table(box=None, show_header=False, padding=(0, 1))
    for justify in ("left", "left", "left", "right", "right", "left"):
        table.add_column(justify=justify)
    if shown and shown[0][0] > 1:
        table.add_row("", "", Text(f"… {shown[0][0] - 1} earlier node(s)", style="dim"), "", "", "")
    for _, node in shown:
        st = node.get("state", "pending")
        job = jobs.get(node["job"]) if node.get("job") is not None else None
        finished, steps = step_counts(job) if job is not None else (0, 0)
        colour = {"failed": "red", "blocked": "red", "rolled_back": "yellow", "cancelled": "yellow"}
        bar = ProgressBar(total=max(steps, 1), completed=finished, width=24,
                          complete_style="cyan", finished_style=colour.get(st, "green"))  # fmt: skip
        table.add_row(
            node.get("node", "?"),
            bar,
            Text(st, style=JOB_STYLE.get(st, "red" if st == "blocked" else "")),
            f"job {node['job']}" if node.get("job") is not None else "",
            f"{finished}/{steps}" if job is not None else "",
            _node_doing(node, job),
        )
    if shown and shown[-1][0] < total:
        table.add_row("", "", Text(f"… {total - shown[-1][0]} more node(s)", style="dim"), "", "", "")
    return Group(rollout_head(rollout), overall, table)


def _node_doing(node: Row, job: Row | None) -> Text:
    """The node's error, else the step its job is running, else nothing."""
    if node.get("error"):
        return Text(str(node["error"]), style="red")
    running = next((s for s in (job or {}).get("steps") or [] if s.get("state") == "running"), None)
    if running is not None:
        return Text(f"{running.get('action', '')} {running.get('target', '')}", style="cyan")
    return Text("")


def rollout_plans_view(answer: Row) -> Table:
    """A rollout's dry run: one row per member with its plan's size, time and what changes."""
    plans: Mapping[str, Row] = answer.get("plans") or {}
    first = next(iter(plans.values()), {})
    mode = (first.get("request") or {}).get("mode", "?")
    table = _table(
        f"rollout plan for group {answer.get('group', '?')}: {mode} on {len(plans)} node(s)",
        "node", "steps", "est.", "GPUs changed", "VMs stopped", "reboot", right=("steps", "est."),
    )  # fmt: skip
    for name, plan in sorted(plans.items()):
        impact = plan.get("impact") or {}
        changes = sorted({f"{a} → {b}" for a, b in (impact.get("gpus") or {}).values()})
        changed = len(impact.get("gpus") or {})
        table.add_row(
            name,
            str(len(plan.get("steps") or [])),
            f"{impact.get('estimated_seconds', 0):g}s",
            f"{changed} ({', '.join(changes)})" if changed else "0",
            Text(", ".join(impact.get("vms_stopped") or []) or "-"),
            Text("yes", style="bold red") if impact.get("reboot_required") else "no",
        )
    return table


def step_line(job: Row, index: int) -> Text:
    """One line for a step that changed state (for logs and non-terminal output)."""
    step = (job.get("steps") or [])[index]
    st = step.get("state", "pending")
    mark = {"done": "✔", "skipped": "·", "failed": "✘", "undone": "↺", "running": "…"}.get(st, " ")
    seconds = step_seconds(step)
    line = Text(f"  {mark} {index + 1}/{len(job['steps'])} ", style=JOB_STYLE.get(st, ""))
    line.append(f"{step.get('action', '')} {step.get('target', '')}")
    line.append(f"  {st}", style=JOB_STYLE.get(st, ""))
    if seconds is not None and st != "running":
        line.append(f" {seconds:.2f}s", style="dim")
    if step.get("error"):
        line.append(f"  {step['error']}", style="red")
    return line


def plan_summary(plan: Row, impact: bool = True) -> RenderableType:
    """A long plan in a few lines: each action once, in order, with how many steps and on what; then the
    impact. The demo shows this; ``switch --dry-run`` shows every step."""
    groups: dict[str, list[str]] = {}
    where: dict[str, str] = {}
    for step in plan.get("steps", []):
        action = step.get("action", "?")
        groups.setdefault(action, []).append(str(step.get("target", "")))
        where[action] = step.get("where", "host")
    request = plan.get("request", {})
    table = _table(
        f"plan for {plan.get('hostname', '?')}: {request.get('mode', '?')} "
        f"({len(plan.get('steps', []))} steps)",
        "action", "steps", "on", "where", right=("steps",),
    )  # fmt: skip
    for action, targets in groups.items():
        unique = list(dict.fromkeys(targets))
        shown = ", ".join(unique[:3]) + (f", … (+{len(unique) - 3})" if len(unique) > 3 else "")
        table.add_row(action, str(len(targets)), Text(shown), where[action])
    return Group(table, impact_view(plan.get("impact", {}))) if impact else table
