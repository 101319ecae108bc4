"""`gpumode journal show | abandon`: look inside the unfinished run of a host, and the way out for one that
cannot settle.

``show`` lists every step of the unfinished run (or of a finished one, by plan id) with its state, error and
undo record, and compares the host with both ways out: what resume and what rollback would still have to do.
``abandon`` shows the same, then, only with ``--yes``, gives the run up: its journal is archived as
``abandoned`` and the host stays exactly as it is, so the next ``apply`` plans from what discovery shows.
Exit codes as the other local verbs: 0 done, 1 nothing to show, 2 bad input (``abandon`` without ``--yes``),
3 another runner holds the host.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from gpumode.cli.exits import EXIT_FAILED, reported
from gpumode.cli.local import JsonOpt, RootOpt

if TYPE_CHECKING:
    from gpumode.modes.engine import JournalCheck
    from gpumode.modes.journal import Journal

app = typer.Typer(help="Inspect or give up the unfinished run of a host.", no_args_is_help=True)
console = Console()


@app.command("show")
def show(
    plan_id: str = typer.Argument(None, help="A finished run's plan id (default: the unfinished run)."),
    root: str = RootOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Every step of the unfinished run (or of PLAN_ID) and how far the host is from resume and rollback."""
    from gpumode.host.root import Host
    from gpumode.modes import engine
    from gpumode.modes.journal import JournalStore

    host = Host(root)
    with reported():
        if plan_id:
            journal = JournalStore(host).finished(plan_id)
            if journal is None:
                _nothing(as_json, f"no finished run {plan_id} on this host")
            assert journal is not None
            check = None
        else:
            check = engine.check_unfinished(host)
            if check is None:
                _nothing(as_json, "no unfinished run on this host")
            assert check is not None
            journal = check.journal
    if as_json:
        print(json.dumps(_journal_dict(journal, check), indent=2, default=str))
        return
    _render(journal, check)


@app.command("abandon")
def abandon(
    yes: bool = typer.Option(False, "--yes", "-y", help="Really give the run up (after reading the check)."),
    root: str = RootOpt,
) -> None:
    """Give up the unfinished run: show the host's state, then (with --yes) archive the journal as abandoned.
    The host is not touched; fix what the check names by hand, or re-apply a mode."""
    from gpumode.host.root import Host
    from gpumode.modes import engine
    from gpumode.modes.policy import RequestError

    host = Host(root)
    with reported():
        check = engine.check_unfinished(host)
        if check is None:
            _nothing(False, "no unfinished run on this host: nothing to abandon")
        assert check is not None
        _render(check.journal, check)
        if not yes:
            raise RequestError(
                "needs_confirmation",
                "abandoning leaves the host exactly as shown above and forgets how to undo this run: "
                "pass --yes to do it (or try `gpumode resume` / `gpumode rollback` first)",
            )
        journal = engine.abandon(host, "the operator ran `gpumode journal abandon --yes`")
    console.print(
        f"[bold yellow]run {journal.plan_id} abandoned[/]: the host stays as shown; "
        "`gpumode status` and `gpumode assert --mode …` tell what it is now, `gpumode apply --mode …` "
        "plans from there",
        highlight=False,
    )
    console.print(f"  journal: {journal.path}", style="dim", highlight=False, soft_wrap=True)


def _nothing(as_json: bool, text: str) -> None:
    if as_json:
        print(json.dumps({"state": "nothing-to-do", "message": text}))
    else:
        console.print(text)
    raise typer.Exit(EXIT_FAILED)


def _render(journal: Journal, check: JournalCheck | None) -> None:
    mode, hostname = journal.plan.request.mode.value, journal.plan.hostname
    console.print(
        f"[bold]run {journal.plan_id}[/] ({mode}) on {hostname}: {journal.state.value}", highlight=False
    )
    if journal.error:
        console.print(f"  {journal.error}", highlight=False)
    table = Table(box=None, padding=(0, 1))
    for column in ("#", "step", "state", "what it remembered / why"):
        table.add_column(column)
    for n, entry in enumerate(journal.steps, 1):
        detail = entry.error or entry.note or ""
        if entry.record:
            detail = (detail + " " if detail else "") + json.dumps(entry.record, default=str)
        table.add_row(str(n), f"{entry.action} {entry.target}", entry.state.value, detail)
    console.print(table)
    if check is None:
        return
    for label, lines, command in (
        ("to finish the run", check.to_target, "gpumode resume"),
        ("to put the host back", check.to_previous, "gpumode rollback"),
    ):
        if lines:
            console.print(f"[bold]{label}[/] (`{command}`), the host still differs:", highlight=False)
            for line in lines:
                console.print(f"  ✘ {line}", highlight=False)
        else:
            console.print(f"[bold]{label}[/] (`{command}`): the host shows that state now", highlight=False)


def _journal_dict(journal: Journal, check: JournalCheck | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "plan_id": journal.plan_id,
        "state": journal.state.value,
        "error": journal.error,
        "mode": journal.plan.request.mode.value,
        "steps": [entry.to_dict() for entry in journal.steps],
    }
    if check is not None:
        out["to_target"] = check.to_target
        out["to_previous"] = check.to_previous
    return out
