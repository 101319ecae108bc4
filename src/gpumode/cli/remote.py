"""Remote verbs: talk to a gpumode server about the whole fleet (``nodes``, ``gpus``, ``cards``, ``modes``,
``events``, ``token``; the switch jobs are in :mod:`gpumode.cli.remote_jobs`, rollouts in
:mod:`gpumode.cli.rollout`).

Every verb takes ``--server``, ``--token`` and ``--config`` (:mod:`gpumode.cli.client` has the precedence;
:func:`remote_verb` adds them, so no verb can connect differently), prints Rich tables (or ``--json``: the
server's JSON, unchanged), and on any refusal prints one line, the server's own message, and exits with the
code documented in docs/cli.md.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console, RenderableType

from gpumode.cli import render
from gpumode.cli.client import EXIT_BAD_INPUT, Client, RemoteError, resolve_config

ServerOpt = typer.Option(None, "--server", "-s", help="Server URL \\[env GPUMODE_SERVER, config `server`].")
TokenOpt = typer.Option(None, "--token", "-t", help="API token \\[env GPUMODE_TOKEN, config `token`].")
ConfigOpt = typer.Option(
    None,
    "--config",
    help="Client config file \\[env GPUMODE_CLIENT_CONFIG; default ~/.config/gpumode/client.toml].",
)
CaOpt = typer.Option(
    None, "--ca", help="CA bundle to verify the server with \\[env GPUMODE_CA, config `ca`; default: system]."
)
JsonOpt = typer.Option(False, "--json", help="Print the server's JSON instead of a table.")
NodeOpt = typer.Option(None, "--node", "-n", help="Only this node.")

MODES = ("accel", "vgpu", "passthrough")
ROLES = ("viewer", "operator", "admin")


def out() -> Console:
    """A console on the current stdout; wide when not a terminal, so piped tables keep every column."""
    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


def fail(message: str, code: int) -> typer.Exit:
    """Print ``error: message`` on stderr and return the exit to raise."""
    Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200).print(
        f"[bold red]error:[/] {message}", soft_wrap=True
    )
    return typer.Exit(code)


@dataclass(frozen=True, slots=True)
class Remote:
    """A verb's ``--server``/``--token``/``--config``, resolved (options > environment > file) on connect."""

    server: str | None = None
    token: str | None = None
    config: Path | None = None
    ca: Path | None = None

    @contextmanager
    def connect(self) -> Iterator[Client]:
        """A client for the resolved server; any :class:`RemoteError` inside becomes one line and an exit
        code."""
        try:
            with Client(resolve_config(self.server, self.token, self.config, ca=self.ca)) as client:
                yield client
        except RemoteError as exc:
            raise fail(str(exc), exc.exit_code) from None


LOCAL = Remote()  # a verb called without options: server and token from the environment or the config file
_CONNECTION = [
    inspect.Parameter("server", inspect.Parameter.KEYWORD_ONLY, default=ServerOpt, annotation=str | None),
    inspect.Parameter("token", inspect.Parameter.KEYWORD_ONLY, default=TokenOpt, annotation=str | None),
    inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=ConfigOpt, annotation=Path | None),
    inspect.Parameter("ca", inspect.Parameter.KEYWORD_ONLY, default=CaOpt, annotation=Path | None),
]


def remote_verb(verb: Callable[..., None]) -> Callable[..., None]:
    """``verb`` as Typer sees it: its own options, then ``--server``, ``--token`` and ``--config``, which it
    gets as one ``remote: Remote`` argument. Every remote verb thus connects the same way, declared once."""
    signature = inspect.signature(verb, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "remote"]
    params = [*own, *_CONNECTION]

    @functools.wraps(verb)
    def run(*args: Any, server: str | None = None, token: str | None = None, config: Path | None = None,
            ca: Path | None = None, **kwargs: Any) -> None:  # fmt: skip
        verb(*args, remote=Remote(server, token, config, ca), **kwargs)

    run.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
    return run


def show(data: Any, as_json: bool, view: RenderableType | None = None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    elif view is not None:
        out().print(view)


def check_choice(value: str | None, allowed: tuple[str, ...], option: str) -> None:
    if value is not None and value not in allowed:
        raise fail(f"{option} {value!r} is not one of: {', '.join(allowed)}", EXIT_BAD_INPUT)


# --- inventory ----------------------------------------------------------------------------------------------


@remote_verb
def nodes(
    group: str | None = typer.Option(None, "--group", help="Only nodes of this host group."),
    mode: str | None = typer.Option(None, "--mode", "-m", help="Only nodes in this mode."),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """List the nodes: mode, driver state, GPU count, when last seen."""
    check_choice(mode, (*MODES, "none", "mixed", "unknown"), "--mode")
    with remote.connect() as client:
        data = client.get("/nodes", group=group, mode=mode)
    show(data, as_json, render.nodes_table(data) if data else "no nodes have joined yet")


@remote_verb
def gpus(
    node: str | None = NodeOpt,
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """List the GPUs of every node (or one): model, mode, driver, vGPUs, IOMMU companions."""
    with remote.connect() as client:
        names = [node] if node else [n["name"] for n in client.get("/nodes")]
        details = [client.get(f"/nodes/{name}") for name in names]
    if as_json:
        show([{"node": d["name"], **g} for d in details for g in d.get("gpus", [])], True)
        return
    if not any(d.get("gpus") for d in details):
        out().print("no GPUs reported")
        return
    out().print(render.gpus_table(details))


@remote_verb
def cards(
    node: str | None = NodeOpt,
    status: str | None = typer.Option(None, "--status", help="free, in_use, reserved or lost."),
    kind: str | None = typer.Option(None, "--kind", help="accel, vgpu or passthrough."),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """List the cloud platform's cards (one per accel GPU, vGPU, or passthrough GPU)."""
    check_choice(status, ("free", "in_use", "reserved", "lost"), "--status")
    check_choice(kind, MODES, "--kind")
    with remote.connect() as client:
        data = client.get("/cards", node=node, status=status, kind=kind)
    show(data, as_json, render.cards_table(data) if data else "no cards")


@remote_verb
def events(
    node: str | None = NodeOpt,
    kind: str | None = typer.Option(None, "--kind", help="An event kind, or a prefix ending in '.'."),
    severity: str | None = typer.Option(None, "--severity", help="info, warning or critical."),
    limit: int = typer.Option(50, "--limit", min=1, max=1000, help="How many, newest first."),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """Show events (hardware changes, card changes, alarms), newest first."""
    check_choice(severity, ("info", "warning", "critical"), "--severity")
    with remote.connect() as client:
        data = client.get("/events", node=node, kind=kind, severity=severity, limit=limit)
    show(data, as_json, render.events_table(data) if data else "no events")


# --- the whitelist ------------------------------------------------------------------------------------------

modes_app = typer.Typer(
    help="The mode whitelist: show it, or (admins) change it.", invoke_without_command=True
)


@modes_app.callback()
@remote_verb
def modes_show(
    ctx: typer.Context,
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """Show the enabled modes: the platform's reference list, narrowed per host group and per GPU model."""
    if ctx.invoked_subcommand is not None:
        return
    with remote.connect() as client:
        data = client.get("/modes")
    show(data, as_json, render.whitelist_view(data))


def _modes(text: str, what: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise fail(f"{what}: {', '.join(bad)} is not a mode (use {', '.join(MODES)})", EXIT_BAD_INPUT)
    return modes


def _assignments(values: list[str], what: str) -> dict[str, list[str] | None]:
    """``NAME=MODE,MODE`` pairs; ``NAME=`` (nothing after '=') removes that entry."""
    result: dict[str, list[str] | None] = {}
    for value in values:
        name, sep, modes = value.partition("=")
        if not sep or not name.strip():
            raise fail(f"{what} {value!r}: expected NAME=MODE[,MODE...] (or NAME= to remove)", EXIT_BAD_INPUT)
        result[name.strip()] = _modes(modes, f"{what} {name.strip()}") if modes.strip() else None
    return result


@modes_app.command("set")
@remote_verb
def modes_set(
    platform: str | None = typer.Option(None, "--platform", help="The reference list, e.g. accel,vgpu."),
    group: list[str] = typer.Option([], "--group", help="GROUP=MODES (repeat); GROUP= removes the rule."),
    model: list[str] = typer.Option([], "--model", help="VENDOR:DEVICE=MODES (repeat); KEY= removes it."),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """Change the whitelist (admin): the levels you name change, the others stay as they are."""
    if platform is None and not group and not model:
        raise fail("nothing to change: give --platform, --group or --model", EXIT_BAD_INPUT)
    new_platform = _modes(platform, "--platform") if platform is not None else None
    groups, models = _assignments(group, "--group"), _assignments(model, "--model")
    with remote.connect() as client:
        doc = client.get("/modes")
        if new_platform is not None:
            doc["platform"] = new_platform
        for key, section in (("groups", groups), ("models", models)):
            for name, modes in section.items():
                if modes is None:
                    doc[key].pop(name, None)
                else:
                    doc[key][name] = modes
        data = client.put("/modes", doc)
    show(data, as_json, render.whitelist_view(data))


# --- tokens -------------------------------------------------------------------------------------------------

token_app = typer.Typer(help="API tokens and join tokens (admin).", no_args_is_help=True)


@token_app.command("create")
@remote_verb
def token_create(
    role: str = typer.Option(..., "--role", "-r", help="viewer, operator or admin."),
    name: str | None = typer.Option(None, "--name", help="What the token is for \\[default: ROLE-cli]."),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """Create an API token; its secret is printed once."""
    check_choice(role, ROLES, "--role")
    with remote.connect() as client:
        data = client.post("/tokens", {"name": name or f"{role}-cli", "role": role})
    if as_json:
        show(data, True)
        return
    console = out()
    console.print(f"{data['role']} token {data['name']!r} (id {data['id']}), shown once:")
    sys.stdout.write(f"{data['token']}\n")


@token_app.command("join")
@remote_verb
def token_join(
    name: str = typer.Option("cli", "--name", help="What the join token is for."),
    uses: int = typer.Option(1, "--uses", min=1, max=100_000, help="How many hosts may join with it."),
    expires_in: int = typer.Option(
        86400, "--expires-in", min=60, max=30 * 86400, help="Seconds it stays valid (at most 30 days)."
    ),
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """Create a join token and print the `gpumode agent` command a host joins with."""
    body = {"name": name, "uses": uses, "expires_in_s": expires_in}
    with remote.connect() as client:
        data = client.post("/join-tokens", body)
    if as_json:
        show(data, True)
        return
    until = render.clock(data.get("expires_at"))
    left = f"{data['uses_left']} use(s)"
    out().print(f"join token {data['name']!r} (id {data['id']}; {left}; expires {until}). On each host:")
    sys.stdout.write(f"  {data['join_command']}\n")


@token_app.command("list")
@remote_verb
def token_list(
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """List API tokens (never their secrets)."""
    with remote.connect() as client:
        data = client.get("/tokens")
    show(data, as_json, render.tokens_table(data))


@token_app.command("revoke")
@remote_verb
def token_revoke(
    token_id: int = typer.Argument(..., help="The token's id (see `gpumode token list`)."),
    remote: Remote = LOCAL,
) -> None:
    """Revoke an API token; calls made with it fail from now on."""
    with remote.connect() as client:
        data = client.delete(f"/tokens/{token_id}")
    out().print(f"revoked token {data['name']!r} (id {data['id']})")


@token_app.command("joins")
@remote_verb
def token_joins(
    as_json: bool = JsonOpt,
    remote: Remote = LOCAL,
) -> None:
    """List join tokens: uses left, expiry (never their secrets)."""
    with remote.connect() as client:
        data = client.get("/join-tokens")
    show(data, as_json, render.join_tokens_table(data))


@token_app.command("revoke-join")
@remote_verb
def token_revoke_join(
    token_id: int = typer.Argument(..., help="The join token's id (see `gpumode token joins`)."),
    remote: Remote = LOCAL,
) -> None:
    """Revoke a join token; no host can join with it from now on."""
    with remote.connect() as client:
        data = client.delete(f"/join-tokens/{token_id}")
    out().print(f"revoked join token {data['name']!r} (id {data['id']})")


@token_app.command("replace")
@remote_verb
def token_replace(
    node: str = typer.Argument(..., help="The node a new or reinstalled host is to take over."),
    remote: Remote = LOCAL,
) -> None:
    """Allow the next join under NODE's name to take the node over without its current node token (a host
    reinstalled or replaced that lost it); valid for 24 hours, audited."""
    with remote.connect() as client:
        data = client.post(f"/nodes/{node}/replace")
    out().print(
        f"the next join as {data['node']} until {render.clock(data['replace_until'])} takes the node over; "
        "its current node token works until then"
    )
