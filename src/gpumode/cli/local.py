"""Local verbs on one host, no server: ``plan``, ``apply``, ``resume``, ``rollback``, ``assert``, ``status``.

Exit codes (scripts and the agent rely on them):

- 0: done (``assert``: the host is in that mode);
- 1: the switch failed (and was rolled back, or stopped with ``--no-rollback``), or ``assert`` found
  differences;
- 2: bad input (unknown mode, mode not allowed, accel+vgpu, unknown vGPU type or GPU, too many vGPUs, a bad
  config file) — nothing was changed;
- 3: another gpumode runner holds the host, or an unfinished run could not be settled.

The heavy modules (discovery, the engine) are imported inside each command so ``gpumode --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, ClassVar

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from gpumode.cli.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, err_console, reported

if TYPE_CHECKING:
    from collections.abc import Iterator

    from gpumode.domain import Plan, SwitchRequest
    from gpumode.host.root import Host
    from gpumode.modes.engine import ApplyResult, HostStatus
    from gpumode.modes.run import ProgressEvent, RunResult

console = Console()


def _host_root(value: str) -> str:
    """``--root`` must be a host's root: one clear line naming the path otherwise, never a traceback."""
    import os

    what = None
    if not os.path.exists(value):
        what = "does not exist"
    elif not os.path.isdir(value):
        what = "is not a directory"
    elif not os.path.isdir(os.path.join(value, "sys/bus/pci/devices")):
        what = "is not a host's root (it has no sys/bus/pci/devices)"
    if what is not None:
        from rich.markup import escape

        err_console.print(
            f"[bold red]error[/] \\[bad_root]: --root {escape(value)} {what}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(EXIT_BAD_INPUT)
    return value


RootOpt = typer.Option(
    "/", "--root", help="Root directory of the host (an emulated host's directory).", callback=_host_root
)
AllowBootVgaOpt = typer.Option(
    False, "--allow-boot-vga", help="Let passthrough take the boot display GPU (the host console goes dark)."
)
WithoutHypervisorOpt = typer.Option(
    False,
    "--without-hypervisor",
    help="When no hypervisor is found (no libvirt-python, no libvirtd), plan without VMs instead of failing.",
)
ModeOpt = typer.Option(None, "--mode", "-m", help="Target mode: accel, vgpu or passthrough.")
GpuOpt = typer.Option(None, "--gpu", "-g", help="A GPU's PCI address (repeat for several; default: all).")
VgpuTypeOpt = typer.Option(None, "--vgpu-type", help="vGPU type: name (L40S-4Q) or id (nvidia-1150, 1150).")
CountOpt = typer.Option(None, "--count", help="vGPUs per GPU (default: as many as the type allows).")
AliasOpt = typer.Option(None, "--alias", help="Passthrough alias the compute service schedules by.")
VmPolicyOpt = typer.Option(
    "gpu",
    "--vm-policy",
    help="Running VMs: all (stop every VM), gpu (only those "
    "holding the GPUs), refuse (fail if any VM is in the way).",
)
JsonOpt = typer.Option(False, "--json", help="Machine-readable output.")
RestartVmsOpt = typer.Option(
    True, "--restart-vms/--no-restart-vms", help="Restart the VMs it shuts down that keep their devices."
)


def _request(
    mode: str | None,
    gpus: list[str] | None,
    vgpu_type: str | None,
    count: int | None,
    alias: str | None,
    vm_policy: str,
    restart_vms: bool = True,
    allow_boot_vga: bool = False,
) -> SwitchRequest:
    """The options as a request, checked by the one request check the server and the dashboard use too."""
    from gpumode.modes.policy import parse_request

    return parse_request(
        mode=mode,
        gpus=gpus or [],
        vgpu_type=vgpu_type,
        vgpu_count=count,
        passthrough_alias=alias,
        vm_policy=vm_policy,
        restart_vms=restart_vms,
        allow_boot_vga=allow_boot_vga,
    )


# --- plan ---------------------------------------------------------------------------------------------------


def plan(
    mode: str = ModeOpt,
    gpu: list[str] = GpuOpt,
    vgpu_type: str = VgpuTypeOpt,
    count: int = CountOpt,
    alias: str = AliasOpt,
    vm_policy: str = VmPolicyOpt,
    restart_vms: bool = RestartVmsOpt,
    root: str = RootOpt,
    allow_boot_vga: bool = AllowBootVgaOpt,
    without_hypervisor: bool = WithoutHypervisorOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Show the steps and the impact of a switch. Changes nothing."""
    from gpumode.host.root import Host
    from gpumode.modes import engine

    config = engine.EngineConfig(without_hypervisor=without_hypervisor)
    with reported():
        the_plan = engine.plan(
            Host(root),
            _request(mode, gpu, vgpu_type, count, alias, vm_policy, restart_vms, allow_boot_vga),
            config=config,
        )
    if as_json:
        print(json.dumps(the_plan.to_dict(), indent=2, default=str))
        return
    render_plan(the_plan)


def render_plan(the_plan: Plan) -> None:
    """The plan and its impact, drawn as the remote ``switch --dry-run`` draws a server's plan."""
    from gpumode.cli import render

    console.print(render.plan_view(the_plan.to_dict()))


# --- apply --------------------------------------------------------------------------------------------------


NoRollbackOpt = typer.Option(
    False, "--no-rollback", help="On failure, stop where it is instead of undoing the plan."
)


def apply(
    mode: str = ModeOpt,
    gpu: list[str] = GpuOpt,
    vgpu_type: str = VgpuTypeOpt,
    count: int = CountOpt,
    alias: str = AliasOpt,
    vm_policy: str = VmPolicyOpt,
    restart_vms: bool = RestartVmsOpt,
    root: str = RootOpt,
    resume: bool = typer.Option(False, "--resume", help="Deprecated: use `gpumode resume`."),
    rollback: bool = typer.Option(
        False,
        "--rollback",
        help="With --mode: undo the unfinished run first, instead of finishing it. "
        "Alone: deprecated, use `gpumode rollback`.",
    ),
    no_rollback: bool = NoRollbackOpt,
    from_desired: bool = typer.Option(
        False, "--from-desired", help="Re-apply each GPU's desired mode (at boot)."
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    allow_boot_vga: bool = AllowBootVgaOpt,
    without_hypervisor: bool = WithoutHypervisorOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Switch the host to --mode (or back to each GPU's desired mode): plan, confirm, run with a journal.

    An unfinished run is finished first (or undone, with --rollback). To only finish or only undo an
    unfinished run, use `gpumode resume` or `gpumode rollback`.
    """
    from gpumode.domain import VmPolicy
    from gpumode.host.root import Host
    from gpumode.modes import engine
    from gpumode.modes.policy import RequestError, parse_vm_policy

    host = Host(root)
    with reported():
        if resume or (rollback and mode is None and not from_desired):
            if resume and rollback:
                raise RequestError("bad_options", "--resume and --rollback exclude each other")
            if mode is not None or from_desired or gpu or vgpu_type or count is not None or alias:
                raise RequestError(
                    "bad_options",
                    "--resume and --rollback (alone) take no --mode, --from-desired or GPU option",
                )
            verb = "resume" if resume else "rollback"
            err_console.print(
                f"[yellow]notice:[/] `gpumode apply --{verb}` is deprecated; use `gpumode {verb}`",
                highlight=False,
            )
            _settle(host, resume=resume, no_rollback=no_rollback, as_json=as_json)
            return
        if (mode is None) == (not from_desired):
            raise RequestError(
                "bad_options",
                "give exactly one of --mode or --from-desired "
                "(`gpumode resume` / `gpumode rollback` settle an unfinished run)",
            )
        if mode is None and (gpu or vgpu_type or count is not None or alias):
            raise RequestError("bad_options", "--gpu, --vgpu-type, --count and --alias go with --mode")
        progress = _Progress(quiet=as_json)
        results: list[RunResult] = []
        if from_desired:
            policy = parse_vm_policy(vm_policy) if vm_policy else VmPolicy.GPU
            with progress.live():
                outcomes = engine.apply_desired(
                    host, progress, vm_policy=policy, rollback_on_failure=not no_rollback
                )
            if not outcomes:
                _say(as_json, {"state": "nothing-to-do"}, "no desired state recorded on this host")
                return
            results.extend(r for o in outcomes for r in _runs(o))
            ok = all(o.ok for o in outcomes)
        else:
            request = _request(mode, gpu, vgpu_type, count, alias, vm_policy, restart_vms, allow_boot_vga)
            config = engine.EngineConfig(without_hypervisor=without_hypervisor)
            if not yes and not as_json:
                the_plan = engine.plan(host, request, config=config)
                render_plan(the_plan)
                if not sys.stdin.isatty():
                    raise RequestError(
                        "needs_confirmation", "not a terminal: pass --yes to apply without asking"
                    )
                if not typer.confirm("apply this plan?", default=False):
                    raise typer.Exit(EXIT_FAILED)
            with progress.live():
                outcome = engine.apply(
                    host,
                    request,
                    progress,
                    rollback_on_failure=not no_rollback,
                    rollback_unfinished=rollback,
                    config=config,
                )
            results.extend(_runs(outcome))
            ok = outcome.ok
    _summary(results, as_json)
    if any(r.interrupted for r in results):
        raise typer.Exit(EXIT_INTERRUPTED)
    if not ok:
        raise typer.Exit(EXIT_FAILED)


def resume(root: str = RootOpt, no_rollback: bool = NoRollbackOpt, as_json: bool = JsonOpt) -> None:
    """Finish the host's unfinished run (after a crash or a kill): each step is checked, the rest run.

    A step that fails is undone with the rest of the run, unless --no-rollback. Exit 0 when the run ends
    done; with no unfinished run, says so and exits 0.
    """
    from gpumode.host.root import Host

    with reported():
        _settle(Host(root), resume=True, no_rollback=no_rollback, as_json=as_json)


def rollback(root: str = RootOpt, as_json: bool = JsonOpt) -> None:
    """Undo the host's unfinished run: every step it touched, newest first, back to where it started.

    Exit 0 when the run ends rolled back; with no unfinished run, says so and exits 0.
    """
    from gpumode.host.root import Host

    with reported():
        _settle(Host(root), resume=False, no_rollback=False, as_json=as_json)


def _settle(host: Host, *, resume: bool, no_rollback: bool, as_json: bool) -> None:
    """Finish (``resume``) or undo the unfinished run; exit 1 unless it ended that way (130 if cut off)."""
    from gpumode.modes import engine

    progress = _Progress(quiet=as_json)
    with progress.live():
        if resume:
            run = engine.resume(host, progress, rollback_on_failure=not no_rollback)
        else:
            run = engine.rollback(host, progress)
    if run is None:
        _say(as_json, {"state": "nothing-to-do"}, "no unfinished run on this host")
        return
    _summary([run], as_json)
    if run.interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)
    if run.state.value != ("done" if resume else "rolled_back"):
        raise typer.Exit(EXIT_FAILED)


def _runs(outcome: ApplyResult) -> list[RunResult]:
    return [r for r in (outcome.previous, outcome.run) if r is not None]


def _say(as_json: bool, data: dict[str, Any], text: str) -> None:
    if as_json:
        print(json.dumps(data))
    else:
        console.print(text)


def _summary(results: list[RunResult], as_json: bool) -> None:
    if as_json:
        print(json.dumps([_run_dict(r) for r in results], indent=2, default=str))
        return
    for r in results:
        counts: dict[str, int] = {}
        for s in r.steps:
            counts[s.state.value] = counts.get(s.state.value, 0) + 1
        spent = sum(s.elapsed_s or 0.0 for s in r.steps)
        tally = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        why = f"; {r.error}" if r.error else ""
        if r.state.value == "done":
            console.print(f"[bold green]✔ run {r.plan_id} done[/]: {tally} ({spent:.2f} s)")
        elif r.state.value == "rolled_back":
            console.print(f"[bold yellow]↺ run {r.plan_id} rolled back[/]: {tally}{why}", highlight=False)
        elif r.interrupted:
            where = f"after step {r.stopped_at}" if r.stopped_at else "before its first step"
            going = "rolling back" if r.state.value == "rolling_back" else "running"
            finishes = "finishes the rollback" if going == "rolling back" else "finishes it"
            console.print(
                f"[bold yellow]⏸ run {r.plan_id} interrupted[/] ({r.interrupted}) while {going}, {where}: "
                f"{tally}; that step finished, nothing is half done\n"
                f"  `gpumode resume` {finishes}, `gpumode rollback` undoes it; "
                "`gpumode journal show` lists every step",
                highlight=False,
            )
        else:
            left = "".join(f"\n  ✘ {line}" for line in r.left)
            state = "rolling back, not finished" if r.state.value == "rolling_back" else "stopped"
            console.print(
                f"[bold red]✘ run {r.plan_id} {state}[/]: {tally}{why if not r.left else ''}{left}\n"
                "  the host is left where it stopped: fix what is named above, then `gpumode resume` "
                "or `gpumode rollback`; `gpumode journal show` lists every step, and "
                "`gpumode journal abandon --yes` gives up on a run that cannot settle",
                highlight=False,
            )
        console.print(f"  journal: {r.journal_path}", style="dim", highlight=False, soft_wrap=True)


def _run_dict(r: RunResult) -> dict[str, Any]:
    return {
        "plan_id": r.plan_id,
        "state": r.state.value,
        "error": r.error,
        "interrupted": r.interrupted,
        "stopped_at": r.stopped_at,
        "left": r.left,
        "undone": r.undone,
        "journal": str(r.journal_path),
        "steps": [asdict(s) for s in r.steps],
    }


class _Progress:
    """A live table, one line per step reached: state and elapsed time; fed by the runner's events."""

    _STYLE: ClassVar[dict[str, str]] = {
        "running": "cyan", "done": "green", "skipped": "dim", "failed": "bold red",
        "undoing": "yellow", "undone": "yellow", "pending": "dim",
    }  # fmt: skip

    def __init__(self, *, quiet: bool) -> None:
        self.quiet = quiet
        self.rows: dict[tuple[str, int, str], list[Any]] = {}
        self.plan_id = ""
        self.total = 0
        self.lines = False  # off a terminal: one plain line per finished step instead of a live table

    def __call__(self, event: ProgressEvent) -> None:
        self.plan_id, self.total = event.plan_id, event.total
        key = (event.plan_id, event.index, event.phase)
        row = self.rows.setdefault(key, [event, time.monotonic(), None])
        row[0] = event
        if event.state.value in ("running", "undoing"):
            row[1], row[2] = time.monotonic(), None
        else:
            row[2] = event.elapsed_s if event.elapsed_s is not None else time.monotonic() - row[1]
            if self.lines:
                what = f"{'undo ' if event.phase == 'undo' else ''}{event.step.action} {event.step.target}"
                error = f": {event.error}" if event.error else ""
                console.print(
                    f"{event.index + 1}/{event.total} {event.state.value:8} {what} {row[2]:.2f}s{error}",
                    highlight=False,
                )

    def __rich__(self) -> RenderableType:
        table = Table(box=None, padding=(0, 1), show_header=False)
        table.add_column(justify="right")
        table.add_column()
        table.add_column()
        table.add_column(justify="right")
        for (_, index, phase), (event, started, elapsed) in self.rows.items():
            state = event.state.value
            running = state in ("running", "undoing")
            mark: RenderableType = (
                Spinner("dots") if running else Text(state, style=self._STYLE.get(state, ""))
            )
            seconds = time.monotonic() - started if elapsed is None else elapsed
            what = f"{'undo ' if phase == 'undo' else ''}{event.step.action} {event.step.target}"
            if event.error:
                what += f"\n  {event.error}"
            table.add_row(f"{index + 1}/{event.total}", mark, Text(what), f"{seconds:.2f}s")
        return Group(Text(f"run {self.plan_id}", style="bold"), table) if self.rows else Text("")

    @contextmanager
    def live(self) -> Iterator[None]:
        if self.quiet:
            yield
            return
        if not console.is_terminal:
            self.lines = True
            yield
            return
        with Live(self, console=console, refresh_per_second=8, transient=False):
            yield


# --- assert / status ----------------------------------------------------------------------------------------


def assert_(
    mode: str = typer.Option(..., "--mode", "-m", help="accel, vgpu, passthrough or none."),
    gpu: list[str] = GpuOpt,
    vgpu_type: str = typer.Option(None, "--vgpu-type", help="vgpu: every vGPU must be of this type."),
    count: int = typer.Option(None, "--count", help="vgpu: exactly this many vGPUs per GPU."),
    root: str = RootOpt,
) -> None:
    """Exit 0 only if the host (or the given GPUs) is in MODE: companions' drivers, driver overrides, VFs,
    vGPU type and count, orphan mdevs included; else list why. A host with no GPU is in no mode."""
    from gpumode.domain import Mode
    from gpumode.host.root import Host
    from gpumode.modes import engine
    from gpumode.modes.policy import RequestError

    with reported():
        try:
            wanted = Mode(mode.strip().lower())
        except ValueError:
            raise RequestError("unknown_mode", f"unknown mode {mode!r}", [m.value for m in Mode]) from None
        if (vgpu_type is not None or count is not None) and wanted is not Mode.VGPU:
            raise RequestError("bad_options", "--vgpu-type and --count go with --mode vgpu")
        if count is not None and count < 0:
            raise RequestError("invalid_option", f"--count must be 0 or more, got {count}")
        differences = engine.assert_mode(
            Host(root), wanted, list(gpu or []), vgpu_type=vgpu_type, vgpu_count=count
        )
    if differences:
        for line in differences:
            console.print(f"[red]✘[/] {line}", highlight=False)
        raise typer.Exit(EXIT_FAILED)
    console.print(f"[green]✔[/] in mode {wanted.value}")


def status(root: str = RootOpt, as_json: bool = JsonOpt) -> None:
    """Current and desired mode per GPU, and any unfinished run."""
    from gpumode.host.root import Host
    from gpumode.modes import engine

    with reported():
        st = engine.status(Host(root))
    if as_json:
        print(json.dumps(_status_dict(st), indent=2, default=str))
        return
    table = Table(title=f"{st.hostname or 'host'}: {st.driver_state}", title_justify="left")
    for col in ("GPU", "model", "mode", "desired", "driver", "vGPUs", "companions"):
        table.add_column(col)
    for g in st.gpus:
        desired = g.desired.mode.value if g.desired else "-"
        mode_style = "green" if g.converged else "bold red"
        companions = ", ".join(f"{a} ({d or 'none'})" for a, d in g.companions.items()) or "-"
        table.add_row(
            g.address, g.name, Text(g.mode.value, style=mode_style), desired, g.driver or "none",
            str(g.vgpus), companions,
        )  # fmt: skip
    console.print(table)
    if st.unfinished is not None:
        j = st.unfinished
        done = sum(1 for s in j.steps if s.state.value in ("done", "skipped"))
        console.print(
            f"[bold yellow]unfinished run[/] {j.plan_id} ({j.plan.request.mode.value}): {j.state.value}, "
            f"{done}/{len(j.steps)} steps; {j.error or ''}\n"
            "  `gpumode resume` finishes it, `gpumode rollback` undoes it, "
            "`gpumode journal show` lists its steps",
            highlight=False,
        )
    elif st.last is not None:
        console.print(f"last run {st.last.plan_id}: {st.last.state.value}", style="dim", highlight=False)
    for problem in st.problems:
        console.print(f"[yellow]![/] {problem}", highlight=False)


def _status_dict(st: HostStatus) -> dict[str, Any]:
    return {
        "hostname": st.hostname,
        "driver_state": st.driver_state,
        "gpus": [
            {
                "address": g.address,
                "name": g.name,
                "mode": g.mode.value,
                "driver": g.driver,
                "desired": g.desired.to_dict() if g.desired else None,
                "companions": g.companions,
                "vgpus": g.vgpus,
            }
            for g in st.gpus
        ],
        "unfinished": None
        if st.unfinished is None
        else {
            "plan_id": st.unfinished.plan_id,
            "state": st.unfinished.state.value,
            "error": st.unfinished.error,
            "steps": {s.id: s.state.value for s in st.unfinished.steps},
        },
        "last": None if st.last is None else {"plan_id": st.last.plan_id, "state": st.last.state.value},
        "problems": st.problems,
    }
