"""Cards follow the hypervisor: a card whose device a VM defined on the host holds is ``in_use`` by that VM
while it runs and ``reserved`` for it while it is shut off; when no VM holds it any more, the hold the
hypervisor made is let go (``free``).

The node's agent reports its VMs with their host devices (a PCI address or an mdev uuid, as in libvirt's
``<hostdev>``), the same ids cards are keyed by. Holds the hypervisor made say so in the holder
(``vm:<name>``), so a hold an operator set by hand (``PATCH /cards/{id}``) is never released here; a VM that
does hold the device wins over it (the device is the VM's, whatever the records said), with an event naming
both. Lost cards are the operator's to release and are left alone.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from gpumode.cloud.base import HELD_STATUSES, Card, CardStatus, CloudPlatform
from gpumode.server.models import Event
from gpumode.server.sync import VM_HOLDER, Severity, make_event


def holders(vms: list[dict[str, Any]]) -> dict[str, tuple[str, bool]]:
    """Device id → (VM name, running) for every host device of every VM defined."""
    found: dict[str, tuple[str, bool]] = {}
    for vm in vms:
        for device in vm.get("devices") or []:
            found[str(device["id"])] = (str(vm["name"]), bool(vm.get("running")))
    return found


def follow_vms(
    platform: CloudPlatform, node: str, vms: list[dict[str, Any]] | None, now: datetime
) -> list[Event]:
    """Set each of ``node``'s cards to what its VMs show; one event per card that changed. ``vms`` is
    ``None`` when the agent never reported VMs: nothing is known, nothing changes. Flushes, the caller
    commits."""
    if vms is None:
        return []
    held = holders(vms)
    events: list[Event] = []
    for card in platform.list_cards(node=node):
        if card.status is CardStatus.LOST:
            continue
        found = held.get(card.device)
        if found is not None:
            name, running = found
            status = CardStatus.IN_USE if running else CardStatus.RESERVED
            holder = f"{VM_HOLDER}{name}"
            if (card.status, card.holder) != (status, holder):
                platform.update_card(card.id, status=status, holder=holder)
                events.append(
                    _event(node, card, "card.held", _held(card, name, running), now, status, holder)
                )
        elif card.status in HELD_STATUSES and (card.holder or "").startswith(VM_HOLDER):
            platform.update_card(card.id, status=CardStatus.FREE, clear_holder=True)
            message = f"{_what(card)} is free: {card.holder} no longer holds its device"
            events.append(_event(node, card, "card.released", message, now, CardStatus.FREE, None))
    return events


def _what(card: Card) -> str:
    return f"{card.kind.value} card {card.id} ({card.device})"


def _held(card: Card, vm: str, running: bool) -> str:
    state = "in use by running VM" if running else "reserved for shut-off VM"
    was = f" (was {card.status.value}" + (f" by {card.holder})" if card.holder else ")")
    return f"{_what(card)} {state} {vm}{was}"


def _event(
    node: str, card: Card, kind: str, message: str, now: datetime, status: CardStatus, holder: str | None
) -> Event:
    before = {"status": card.status.value, "holder": card.holder}
    after = {"status": status.value, "holder": holder}
    return make_event(node, kind, Severity.INFO, card.device, message, now, before=before, after=after)
