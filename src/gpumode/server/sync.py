"""Hardware sync (method step 1): fold a host's reported snapshot into the database.

Same fingerprint as stored → nothing to do, and nothing is written (the report route checks the stored
fingerprint first, in its one indexed read: :mod:`gpumode.server.routes.reports`). Otherwise, in the caller's
transaction:

1. diff the physical PCI functions against the stored snapshot — added, removed, or changed identity
   (vendor:device, subsystem ids, IOMMU group) — and each GPU's mode and driver; every difference is an event
   with its before and after;
2. reconcile the cards with those the new snapshot offers (:func:`gpumode.cloud.base.cards_for_snapshot`): a
   card whose device is gone or is no longer the same device is removed, unless someone holds it — then it is
   marked ``lost`` and an alarm is raised, and it stays until an operator releases it; new devices get new
   cards;
3. replace the stored snapshot, and the node's rows in ``node_gpus`` (:mod:`gpumode.server.gpu_index`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpumode.cloud.base import (
    HELD_STATUSES,
    Card,
    CardSpec,
    CardStatus,
    CloudError,
    CloudPlatform,
    SwitchHooks,
    cards_for_snapshot,
)
from gpumode.domain import HostSnapshot, Mode
from gpumode.server import gpu_index
from gpumode.server.models import ACTIVE_JOB_STATES, Event, Job, Node

# The holder of a card the hypervisor holds: a VM defined on the host (gpumode.server.card_holders).
VM_HOLDER = "vm:"


class Severity:
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


@dataclass(slots=True)
class SyncResult:
    """What one report changed."""

    node: str
    changed: bool
    created: bool = False
    events: list[Event] = field(default_factory=list)
    cards_added: int = 0
    cards_removed: int = 0
    cards_lost: int = 0
    cards_recovered: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "changed": self.changed,
            "created": self.created,
            "events": len(self.events),
            "cards_added": self.cards_added,
            "cards_removed": self.cards_removed,
            "cards_lost": self.cards_lost,
            "cards_recovered": self.cards_recovered,
        }


def host_mode(snapshot: HostSnapshot) -> str:
    """One word for the host: its GPUs' common mode, ``mixed``, or ``none`` without GPUs."""
    modes = {gpu.mode.value for gpu in snapshot.gpus}
    if not modes:
        return "none"
    return modes.pop() if len(modes) == 1 else "mixed"


def apply_snapshot(
    session: Session,
    platform: CloudPlatform,
    snapshot: HostSnapshot,
    *,
    now: datetime,
    node: Node | None = None,
    stored: dict[str, Any] | None = None,
) -> tuple[Node, SyncResult]:
    """Diff, reconcile cards, record events, store ``snapshot``. Flushes; the caller commits.

    ``stored`` is ``snapshot.to_dict()`` when the caller has it already (a parsed report does): the diff
    reads the stored forms, old and new, so the old snapshot is never rebuilt as objects.
    """
    created = node is None
    new = snapshot.to_dict() if stored is None else stored
    old = None if node is None else node.snapshot
    result = SyncResult(node=snapshot.hostname, changed=True, created=created)
    if node is None:
        node = Node(name=snapshot.hostname, created_at=now)  # added once complete: card queries autoflush
        result.events.append(
            make_event(
                snapshot.hostname,
                "node.joined",
                Severity.INFO,
                None,
                f"node {snapshot.hostname} joined with {len(snapshot.gpus)} GPU(s)",
                now,
            )
        )
    result.events.extend(_hardware_events(snapshot.hostname, old, new, now))
    job = None if created else _switching(session, snapshot.hostname)
    _reconcile_cards(platform, snapshot, result, now, gone=f"removed by switch job {job}" if job else None)
    if not created and job is None:
        result.events.extend(_cloud_drift(platform, snapshot, now))
    node.snapshot = new
    node.fingerprint = snapshot.fingerprint
    node.mode = host_mode(snapshot)
    node.driver_state = snapshot.driver_state.value
    node.gpu_count = len(snapshot.gpus)
    node.changed_at = now
    session.add(node)
    session.add_all(result.events)
    session.flush()
    gpu_index.store(session, node.id, new, old)  # the dashboard's per-GPU rows, in this transaction
    return node, result


# --- hardware diff
# -----------------------------------------------------------------------------------------------


def _identity(fn: dict[str, Any]) -> dict[str, Any]:
    """What makes a function the same device, from its stored form."""
    return {
        "address": fn["address"],
        "id": f"{fn['vendor']:04x}:{fn['device']:04x}",
        "subsystem": f"{fn['subsystem_vendor']:04x}:{fn['subsystem_device']:04x}",
        "iommu_group": fn.get("iommu_group"),
        "class": f"{fn['class_code']:06x}",
        "name": fn.get("device_name"),
    }


def _physical(snapshot: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {fn["address"]: fn for fn in (snapshot or {}).get("functions", []) if fn.get("physfn") is None}


def _hardware_events(
    node: str, old: dict[str, Any] | None, new: dict[str, Any], now: datetime
) -> list[Event]:
    """Physical functions added, removed or changed in identity; GPUs whose mode or driver changed. Both
    snapshots in their stored form; a function whose stored form is equal is not looked into.

    VFs are left out: they come and go with SR-IOV configuration, not hardware, and their vGPU cards are
    reconciled on their own.
    """
    before, after = _physical(old), _physical(new)
    events: list[Event] = []
    for address in sorted(before.keys() | after.keys()):
        was, now_fn = before.get(address), after.get(address)
        if was is None and now_fn is not None:
            if old is not None:  # on the first report everything is "new"; node.joined says so once
                events.append(
                    make_event(
                        node,
                        "hardware.added",
                        Severity.INFO,
                        address,
                        f"{address} appeared ({now_fn.get('device_name') or _identity(now_fn)['id']})",
                        now,
                        after=_identity(now_fn),
                    )
                )
        elif was is not None and now_fn is None:
            events.append(
                make_event(
                    node,
                    "hardware.removed",
                    Severity.WARNING,
                    address,
                    f"{address} disappeared",
                    now,
                    before=_identity(was),
                )
            )
        elif was is not None and now_fn is not None and was != now_fn:
            a, b = _identity(was), _identity(now_fn)
            if a == b:
                continue
            what = ", ".join(k for k in a if a[k] != b[k])
            events.append(
                make_event(
                    node,
                    "hardware.changed",
                    Severity.WARNING,
                    address,
                    f"{address} is no longer the same device ({what} changed)",
                    now,
                    before=a,
                    after=b,
                )
            )
    old_gpus = {g["address"]: g for g in (old or {}).get("gpus", [])}
    for gpu in new["gpus"]:
        prev = old_gpus.get(gpu["address"])
        if prev is None:
            continue
        was_mode, mode = str(Mode(prev["mode"])), str(Mode(gpu["mode"]))
        if (was_mode, prev["driver"]) != (mode, gpu["driver"]):
            events.append(
                make_event(
                    node,
                    "gpu.mode_changed",
                    Severity.INFO,
                    gpu["address"],
                    f"{gpu['address']}: {was_mode} ({prev['driver']}) -> {mode} ({gpu['driver']})",
                    now,
                    before={"mode": was_mode, "driver": prev["driver"]},
                    after={"mode": mode, "driver": gpu["driver"]},
                )
            )
    return events


# --- cards
# -------------------------------------------------------------------------------------------------------


def _reconcile_cards(
    platform: CloudPlatform, snapshot: HostSnapshot, result: SyncResult, now: datetime, *, gone: str | None
) -> None:
    """``gone``: why devices went, when a switch job took them (else they are "gone" unplanned)."""
    node = snapshot.hostname
    desired = {spec.key: spec for spec in cards_for_snapshot(snapshot)}
    existing = platform.list_cards(node=node)
    satisfied: set[tuple[str, str]] = set()
    to_remove: list[Card] = []
    # Live cards first, so that a lost card never duplicates one still serving the same device.
    for card in sorted(existing, key=lambda c: c.status is CardStatus.LOST):
        spec = desired.get(card.key)
        same_device = spec is not None and spec.gpu == card.gpu and spec.identity == card.identity
        if same_device and card.key not in satisfied:
            satisfied.add(card.key)
            if card.status is CardStatus.LOST:
                restored = CardStatus.IN_USE if card.holder else CardStatus.FREE
                platform.update_card(card.id, status=restored)
                result.cards_recovered += 1
                result.events.append(
                    make_event(
                        node,
                        "card.recovered",
                        Severity.WARNING,
                        card.device,
                        f"{card.kind.value} card {card.id} ({card.device}) is back; status {restored.value}",
                        now,
                        before=_card(card),
                    )
                )
            continue
        reason = (gone or "device gone") if spec is None else "device changed"
        # A VM's hold on a device a switch took away was in the plan's impact (its VMs stop): not a loss.
        planned = gone is not None and spec is None and (card.holder or "").startswith(VM_HOLDER)
        if card.status in HELD_STATUSES and not planned:
            platform.update_card(card.id, status=CardStatus.LOST)
            result.cards_lost += 1
            result.events.append(
                make_event(
                    node,
                    "alarm.card_lost",
                    Severity.CRITICAL,
                    card.device,
                    f"{card.kind.value} card {card.id} ({card.device}) held by "
                    f"{card.holder or 'unknown'} is lost: {reason}; kept until released",
                    now,
                    before=_card(card),
                    after=_spec(spec),
                )
            )
        elif card.status is not CardStatus.LOST:
            to_remove.append(card)
            result.events.append(
                make_event(
                    node,
                    "card.removed",
                    Severity.WARNING if planned else Severity.INFO,
                    card.device,
                    f"{card.kind.value} card {card.id} ({card.device}) removed: {reason}"
                    + (f"; it was {card.status.value} for {card.holder}" if planned else ""),
                    now,
                    before=_card(card),
                    after=_spec(spec),
                )
            )
    platform.remove_cards([c.id for c in to_remove])
    result.cards_removed += len(to_remove)
    new_specs: list[CardSpec] = [spec for key, spec in desired.items() if key not in satisfied]
    for card in platform.register_cards(new_specs):
        result.events.append(
            make_event(
                node,
                "card.added",
                Severity.INFO,
                card.device,
                f"{card.kind.value} card {card.id} ({card.device}) registered",
                now,
                after=_card(card),
            )
        )
    result.cards_added += len(new_specs)


# --- the cloud's picture of the host
# ----------------------------------------------------------------------------------


def _switching(session: Session, node: str) -> int | None:
    """The switch job under way, if any: its own cloud steps set the cloud up once the host is done; a sync
    in between would see a host in flux and mark the cloud before the new inventory is there. The devices
    it takes away are its doing, and their cards say so."""
    query = select(Job.id).where(Job.node == node, Job.state.in_(ACTIVE_JOB_STATES)).limit(1)
    job: int | None = session.scalar(query)
    return job


def _cloud_drift(platform: CloudPlatform, snapshot: HostSnapshot, now: datetime) -> list[Event]:
    """Let a platform with switch hooks compare its picture with the changed host (``sync_hardware``): one
    event per disagreement, a warning for what it could not fix; a platform that fails is an event too, never
    a failed report (the host's own facts are stored regardless)."""
    if not isinstance(platform, SwitchHooks):
        return []
    node = snapshot.hostname
    try:
        drift = platform.sync_hardware(snapshot)
    except CloudError as exc:
        return [
            make_event(node, "cloud.sync_failed", Severity.WARNING, None, f"cloud sync failed: {exc}", now)
        ]
    return [
        make_event(
            node,
            "cloud.drift_fixed" if d.fixed else "cloud.drift",
            Severity.INFO if d.fixed else Severity.WARNING,
            d.provider[:128],
            f"{d.provider}: {d.problem}",
            now,
        )
        for d in drift
    ]


def _card(card: Card) -> dict[str, Any]:
    return {
        "id": card.id,
        "kind": card.kind.value,
        "gpu": card.gpu,
        "device": card.device,
        "identity": card.identity,
        "vgpu_type": card.vgpu_type,
        "status": card.status.value,
        "holder": card.holder,
    }


def _spec(spec: CardSpec | None) -> dict[str, Any] | None:
    if spec is None:
        return None
    return {
        "kind": spec.kind.value,
        "gpu": spec.gpu,
        "device": spec.device,
        "identity": spec.identity,
        "vgpu_type": spec.vgpu_type,
    }


def make_event(
    node: str | None,
    kind: str,
    severity: str,
    target: str | None,
    message: str,
    now: datetime,
    *,
    before: Any = None,
    after: Any = None,
) -> Event:
    return Event(
        node=node,
        kind=kind,
        severity=severity,
        target=target,
        message=message,
        before=before,
        after=after,
        created_at=now,
    )
