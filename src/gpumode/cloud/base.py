"""The cloud platform as gpumode sees it: cards that a scheduler hands to workloads, plus the user-registered
vGPU profiles and passthrough aliases those cards are offered under.

A *card* is one schedulable unit of a GPU host in one mode: an accelerator card per GPU in ``accel``, a vGPU
card per vGPU instance (an mdev, or an SR-IOV VF with a vendor vGPU type set) in ``vgpu``, a passthrough card
per GPU bound to ``vfio-pci``. Which cards a host should have follows from its snapshot alone
(:func:`cards_for_snapshot`); a platform stores them and tracks who holds them. The embedded platform keeps
them in gpumode's own database; an OpenStack one would map them to Placement providers, Cyborg deployables and
Nova aliases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from gpumode.domain import HostSnapshot, Mode, PciFunction, Plan, Step, VmPolicy


class CardStatus(StrEnum):
    """Where a card stands with the scheduler."""

    FREE = "free"
    IN_USE = "in_use"  # a VM or workload holds it; never dropped silently
    RESERVED = "reserved"  # promised to someone, not yet attached
    LOST = "lost"  # its device vanished or changed while held: kept for the operator, alarm raised


HELD_STATUSES = frozenset({CardStatus.IN_USE, CardStatus.RESERVED})


class CardError(ValueError):
    """A card operation named something that does not exist or is not allowed."""


class CloudError(RuntimeError):
    """The cloud platform failed, is unreachable, or refuses a switch; the message names what and where."""


class CloudUnavailable(CloudError):
    """The platform cannot do it now but may soon (unreachable, 5xx, a write conflict, or it does not show
    the host's new state yet): worth trying again until a deadline. Nothing is left half-written."""


@dataclass(frozen=True, slots=True)
class CardSpec:
    """A card a host should have, derived from its snapshot.

    ``device`` is what the card hands out (the GPU address, an mdev uuid or a VF address); ``identity`` pins
    the physical GPU behind it (vendor:device, subsystem ids, IOMMU group) so a swapped board at the same
    address is recognised as a different card.
    """

    node: str
    kind: Mode
    gpu: str
    device: str
    identity: str
    vgpu_type: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind.value, self.device)


@dataclass(slots=True)
class Card:
    """A stored card."""

    id: int
    node: str
    kind: Mode
    gpu: str
    device: str
    identity: str
    vgpu_type: str | None
    status: CardStatus
    holder: str | None
    created_at: datetime
    updated_at: datetime

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind.value, self.device)


@dataclass(frozen=True, slots=True)
class CardCounts:
    """How many cards are in each status: fleet-wide, and for each node asked about (a node without cards
    is absent). Statuses without cards are absent too."""

    total: dict[CardStatus, int]
    by_node: dict[str, dict[CardStatus, int]]


@dataclass(frozen=True, slots=True)
class VgpuProfile:
    """A user-registered vGPU layout: ``count_per_gpu`` instances of ``vgpu_type`` on each GPU."""

    name: str
    vgpu_type: str
    count_per_gpu: int
    description: str = ""


@dataclass(frozen=True, slots=True)
class PassthroughAlias:
    """The name a compute service schedules whole GPUs by (Nova's ``[pci] alias``)."""

    name: str
    vendor_id: int
    product_id: int
    description: str = ""


class CloudPlatform(Protocol):
    """What the server needs from a cloud platform. Implementations never commit: the caller owns the
    transaction, so a sync's card changes land together with its snapshot and events, or not at all.
    """

    def list_cards(
        self, *, node: str | None = None, status: CardStatus | None = None, kind: Mode | None = None
    ) -> list[Card]: ...

    def get_card(self, card_id: int) -> Card | None: ...

    def register_cards(self, specs: Sequence[CardSpec]) -> list[Card]: ...

    def remove_cards(self, card_ids: Sequence[int]) -> None: ...

    def update_card(
        self,
        card_id: int,
        *,
        status: CardStatus | None = None,
        holder: str | None = None,
        clear_holder: bool = False,
    ) -> Card: ...

    def count_cards(self, nodes: Sequence[str] = ()) -> CardCounts:
        """Cards per status, fleet-wide and for each of ``nodes``, counted where the cards are kept (the
        dashboard's totals: cheap at any fleet size, never a listing of every card)."""
        ...

    def list_profiles(self) -> list[VgpuProfile]: ...

    def put_profile(self, profile: VgpuProfile) -> VgpuProfile: ...

    def delete_profile(self, name: str) -> None: ...

    def list_aliases(self) -> list[PassthroughAlias]: ...

    def put_alias(self, alias: PassthroughAlias) -> PassthroughAlias: ...

    def delete_alias(self, name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Drift:
    """One disagreement between the cloud's picture of a host and the host; ``fixed`` when gpumode put it
    right."""

    provider: str
    problem: str
    fixed: bool


@dataclass(frozen=True, slots=True)
class CloudHostSteps:
    """Host steps a platform needs in a switch plan (e.g. deliver a config file, restart a service).

    ``last`` runs after the host steps, right before the cloud steps. ``first`` runs before every host step,
    so its undo runs after every other undo when the host is rolled back (e.g. restart a service once the
    host and its configuration are back as they were).
    """

    first: tuple[Step, ...] = ()
    last: tuple[Step, ...] = ()


@runtime_checkable
class SwitchHooks(Protocol):
    """What a platform does around a switch job, beyond cards. The server calls these when the platform
    has them (``isinstance(platform, SwitchHooks)``); the embedded platform's are no-ops.

    Order in a job: :meth:`host_steps` when planning; :meth:`ready` and :meth:`before_switch` when the agent
    claims the job; :meth:`ready` again when a step with ``checkpoint: true`` is reported done;
    :meth:`set_up_cards` in ``cloud.register_cards``; :meth:`after_switch` when the job ends, however it
    ends. :meth:`sync_hardware` runs on a changed hardware report while no job is active on the node.
    """

    @property
    def ready_timeout_s(self) -> float:
        """How long a job waits for :meth:`ready` before it fails."""
        ...

    @property
    def retry_timeout_s(self) -> float:
        """How long a job's cloud steps keep trying while :meth:`set_up_cards` says
        :class:`CloudUnavailable`, before the host's run is undone."""
        ...

    @property
    def retry_interval_s(self) -> float:
        """The first wait between such tries (then doubling)."""
        ...

    def ready(self) -> str | None:
        """None when the platform can take a switch now, else why not (unreachable, erroring)."""
        ...

    def host_steps(self, plan: Plan, snapshot: HostSnapshot) -> CloudHostSteps:
        """Steps to add to ``plan`` (made from ``snapshot``); raises :class:`CloudError` to refuse it."""
        ...

    def before_switch(self, node: str, *, job: str, policy: VmPolicy) -> dict[str, Any]:
        """Take the node out of scheduling; returns a JSON *hold* the server stores with the job."""
        ...

    def after_switch(self, hold: dict[str, Any], *, succeeded: bool) -> list[str]:
        """Undo :meth:`before_switch` from its hold; returns what could not be undone."""
        ...

    def set_up_cards(
        self, snapshot: HostSnapshot, *, alias: str | None = None, delivered: bool = False, wait: bool = True
    ) -> str:
        """Make the cloud offer the host's cards as ``snapshot`` shows them; returns a note for the job.
        ``delivered``: the plan's host steps already delivered what the host needs. ``wait=False``: one try,
        :class:`CloudUnavailable` when the platform is away for now (the caller tries again later); any
        failure leaves nothing half-written."""
        ...

    def sync_hardware(self, snapshot: HostSnapshot) -> list[Drift]:
        """Make the cloud agree with the host where gpumode may; report the rest."""
        ...


# --- deriving cards from a snapshot
# ----------------------------------------------------------------------------


def function_identity(fn: PciFunction | None) -> str:
    """What must stay the same for a device at one address to still be the same device.

    Returns ``"unknown"`` when the snapshot lists a GPU without its function entry (a malformed agent); such a
    GPU never matches a stored card, so its cards are re-derived rather than trusted.
    """
    if fn is None:
        return "unknown"
    group = "-" if fn.iommu_group is None else str(fn.iommu_group)
    ids = f"{fn.vendor:04x}:{fn.device:04x} sub {fn.subsystem_vendor:04x}:{fn.subsystem_device:04x}"
    return f"{ids} group {group}"


def cards_for_snapshot(snapshot: HostSnapshot) -> list[CardSpec]:
    """The cards a host in this state offers, one per schedulable unit, in a stable order."""
    node = snapshot.hostname
    by_address = {fn.address: fn for fn in snapshot.functions}
    # a vGPU card shows its type by name ("GRID T4-4Q"), as its parent lists it; by id when it does not
    type_names = {t.type_id: t.name for fn in snapshot.functions for t in fn.mdev_types if t.name}
    mdev_types = {m.uuid: type_names.get(m.type_id, m.type_id) for fn in snapshot.functions for m in fn.mdevs}
    specs: list[CardSpec] = []
    for gpu in sorted(snapshot.gpus, key=lambda g: g.address):
        identity = function_identity(by_address.get(gpu.address))
        if gpu.mode is Mode.ACCEL:
            specs.append(CardSpec(node, Mode.ACCEL, gpu.address, gpu.address, identity))
        elif gpu.mode is Mode.PASSTHROUGH:
            specs.append(CardSpec(node, Mode.PASSTHROUGH, gpu.address, gpu.address, identity))
        elif gpu.mode is Mode.VGPU:
            for uuid in sorted(gpu.mdevs):
                specs.append(CardSpec(node, Mode.VGPU, gpu.address, uuid, identity, mdev_types.get(uuid)))
            for vf in sorted(gpu.vgpus):
                specs.append(
                    CardSpec(node, Mode.VGPU, gpu.address, vf, identity, _vendor_type(by_address.get(vf)))
                )
    return specs


def _vendor_type(vf: PciFunction | None) -> str | None:
    """The vGPU type set on a VF through the vendor VFIO interface, by name when the VF still lists it (else
    its numeric id)."""
    if vf is None or vf.vendor_vgpu is None or vf.vendor_vgpu.current == 0:
        return None
    current = vf.vendor_vgpu.current
    return vf.vendor_vgpu.creatable.get(current) or str(current)
