"""Operator verbs for what the fleet is made of: host groups, a card's holder (releasing a lost card), vGPU
profiles and passthrough aliases. Each is one call (or a read and a write) of the REST API, connected like
every remote verb (:func:`gpumode.cli.remote.remote_verb`)."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from gpumode.cli.client import EXIT_BAD_INPUT, EXIT_CONFLICT, EXIT_FAILED
from gpumode.cli.remote import LOCAL, JsonOpt, Remote, fail, out, remote_verb, show

# --- host groups --------------------------------------------------------------------------------------------

group_app = typer.Typer(help="Host groups: create, assign nodes, remove nodes, delete.", no_args_is_help=True)


def _table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table


@remote_verb
def groups(as_json: bool = JsonOpt, remote: Remote = LOCAL) -> None:
    """List the host groups and their nodes."""
    with remote.connect() as client:
        data = client.get("/groups")
    rows = [[g["name"], str(len(g["nodes"])), ", ".join(g["nodes"]) or "-"] for g in data]
    view = _table("host groups", ["group", "nodes", "members"], rows)
    show(data, as_json, view if data else "no host groups")


def _members(client: Any, name: str) -> list[str] | None:
    for group in client.get("/groups"):
        if group["name"] == name:
            return list(group["nodes"])
    return None


@group_app.command("create")
@remote_verb
def group_create(
    name: str = typer.Argument(..., help="The new group's name."),
    nodes: list[str] = typer.Argument(None, help="Nodes to put in it (each leaves its current group)."),
    remote: Remote = LOCAL,
) -> None:
    """Create a host group, optionally with nodes (refused if it exists: use `group assign`)."""
    with remote.connect() as client:
        if _members(client, name) is not None:
            raise fail(f"host group {name!r} exists; add nodes with: gpumode group assign {name} NODE…",
                       EXIT_CONFLICT)  # fmt: skip
        result = client.put(f"/groups/{name}", {"nodes": sorted(set(nodes or []))})
    out().print(f"host group {name} created: {', '.join(result['nodes']) or 'no nodes yet'}")


@group_app.command("assign")
@remote_verb
def group_assign(
    name: str = typer.Argument(..., help="The group."),
    nodes: list[str] = typer.Argument(..., help="Nodes to add (each leaves its current group)."),
    replace: bool = typer.Option(False, "--replace", help="Make these the only members."),
    remote: Remote = LOCAL,
) -> None:
    """Put nodes in a host group (a node is in at most one group)."""
    with remote.connect() as client:
        current = _members(client, name)
        if current is None:
            raise fail(f"no host group named {name!r}; create it with: gpumode group create {name}",
                       EXIT_FAILED)  # fmt: skip
        wanted = sorted(set(nodes) if replace else set(current) | set(nodes))
        result = client.put(f"/groups/{name}", {"nodes": wanted})
    out().print(f"host group {name}: {', '.join(result['nodes']) or 'no nodes'}")


@group_app.command("remove")
@remote_verb
def group_remove(
    name: str = typer.Argument(..., help="The group."),
    nodes: list[str] = typer.Argument(..., help="Nodes to take out of it."),
    remote: Remote = LOCAL,
) -> None:
    """Take nodes out of a host group (they stay in the fleet, in no group)."""
    with remote.connect() as client:
        current = _members(client, name)
        if current is None:
            raise fail(f"no host group named {name!r}", EXIT_FAILED)
        strangers = sorted(set(nodes) - set(current))
        if strangers:
            raise fail(f"not in host group {name}: {', '.join(strangers)}", EXIT_BAD_INPUT)
        result = client.put(f"/groups/{name}", {"nodes": sorted(set(current) - set(nodes))})
    out().print(f"host group {name}: {', '.join(result['nodes']) or 'no nodes'}")


@group_app.command("delete")
@remote_verb
def group_delete(name: str = typer.Argument(..., help="The group."), remote: Remote = LOCAL) -> None:
    """Delete a host group and its whitelist rule; its nodes stay, in no group."""
    with remote.connect() as client:
        client.delete(f"/groups/{name}")
    out().print(f"host group {name} deleted")


# --- cards --------------------------------------------------------------------------------------------------

card_app = typer.Typer(help="One card: release it (a lost one is removed), or give it a holder.",
                       no_args_is_help=True)  # fmt: skip


@card_app.command("release")
@remote_verb
def card_release(
    card_id: int = typer.Argument(..., help="The card's id (gpumode cards)."), remote: Remote = LOCAL
) -> None:
    """Free a card; a lost card (its device is gone) is removed, after its holder was dealt with."""
    with remote.connect() as client:
        before = _card(client, card_id)
        client.request("PATCH", f"/cards/{card_id}", json={"status": "free"})
    if before["status"] == "lost":
        out().print(f"lost card {card_id} ({before['node']} {before['device']}) released and removed")
    else:
        out().print(f"card {card_id} is free")


@card_app.command("assign")
@remote_verb
def card_assign(
    card_id: int = typer.Argument(..., help="The card's id (gpumode cards)."),
    holder: str = typer.Option(..., "--holder", help="Who holds it now (a VM, a workload)."),
    reserve: bool = typer.Option(False, "--reserve", help="Promised to the holder, not attached yet."),
    remote: Remote = LOCAL,
) -> None:
    """Record who holds a card (in use, or reserved); a lost card can only be released."""
    status = "reserved" if reserve else "in_use"
    with remote.connect() as client:
        card = client.request("PATCH", f"/cards/{card_id}", json={"status": status, "holder": holder})
    out().print(f"card {card_id} is {card['status']}, held by {card['holder']}")


def _card(client: Any, card_id: int) -> dict[str, Any]:
    for card in client.get("/cards"):
        if card["id"] == card_id:
            return dict(card)
    raise fail(f"no card with id {card_id} (see: gpumode cards)", EXIT_FAILED)


# --- vGPU profiles and passthrough aliases ------------------------------------------------------------------

profile_app = typer.Typer(help="vGPU profiles: a named vGPU type and count per GPU.", no_args_is_help=True)
alias_app = typer.Typer(
    help="Passthrough aliases: the name VMs ask for a GPU model by.", no_args_is_help=True
)


@remote_verb
def profiles(as_json: bool = JsonOpt, remote: Remote = LOCAL) -> None:
    """List the vGPU profiles."""
    with remote.connect() as client:
        data = client.get("/profiles")
    rows = [[p["name"], p["vgpu_type"], str(p["count_per_gpu"]), p["description"]] for p in data]
    view = _table("vGPU profiles", ["profile", "vGPU type", "per GPU", "description"], rows)
    show(data, as_json, view if data else "no vGPU profiles")


@profile_app.command("set")
@remote_verb
def profile_set(
    name: str = typer.Argument(..., help="The profile's name."),
    vgpu_type: str = typer.Option(..., "--vgpu-type", help="The vGPU type by name, e.g. L40S-4Q."),
    count: int = typer.Option(..., "--count", help="vGPUs per GPU."),
    description: str = typer.Option("", "--description", help="Free text."),
    remote: Remote = LOCAL,
) -> None:
    """Create or change a vGPU profile."""
    body = {"vgpu_type": vgpu_type, "count_per_gpu": count, "description": description}
    with remote.connect() as client:
        result = client.put(f"/profiles/{name}", body)
    out().print(f"vGPU profile {name}: {result['count_per_gpu']} × {result['vgpu_type']} per GPU")


@profile_app.command("delete")
@remote_verb
def profile_delete(name: str = typer.Argument(..., help="The profile."), remote: Remote = LOCAL) -> None:
    """Delete a vGPU profile."""
    with remote.connect() as client:
        client.delete(f"/profiles/{name}")
    out().print(f"vGPU profile {name} deleted")


@remote_verb
def aliases(as_json: bool = JsonOpt, remote: Remote = LOCAL) -> None:
    """List the passthrough aliases."""
    with remote.connect() as client:
        data = client.get("/aliases")
    rows = [[a["name"], f"{a['vendor_id']}:{a['product_id']}", a["description"]] for a in data]
    show(data, as_json, _table("passthrough aliases", ["alias", "vendor:device", "description"], rows)
         if data else "no passthrough aliases")  # fmt: skip


@alias_app.command("set")
@remote_verb
def alias_set(
    name: str = typer.Argument(..., help="The alias, as VMs' flavors name it."),
    vendor: str = typer.Option("10de", "--vendor", help="PCI vendor id, hex."),
    device: str = typer.Option(..., "--device", help="PCI device id, hex (e.g. 2330 for an H100 SXM5)."),
    description: str = typer.Option("", "--description", help="Free text."),
    remote: Remote = LOCAL,
) -> None:
    """Create or change a passthrough alias."""
    body = {"vendor_id": vendor, "product_id": device, "description": description}
    with remote.connect() as client:
        result = client.put(f"/aliases/{name}", body)
    out().print(f"passthrough alias {name}: {result['vendor_id']}:{result['product_id']}")


@alias_app.command("delete")
@remote_verb
def alias_delete(name: str = typer.Argument(..., help="The alias."), remote: Remote = LOCAL) -> None:
    """Delete a passthrough alias."""
    with remote.connect() as client:
        client.delete(f"/aliases/{name}")
    out().print(f"passthrough alias {name} deleted")
