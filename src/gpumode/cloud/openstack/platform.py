"""OpenStack as gpumode's cloud platform.

Cards, gpumode's own vGPU profiles and passthrough aliases stay in gpumode's database (the embedded platform):
they carry ids and holders that OpenStack has no place for. What the scheduler uses lives in OpenStack:

- before a switch, :meth:`OpenStackPlatform.before_switch` disables the host's nova-compute service and
  applies the VM policy through Nova; :meth:`after_switch` re-enables it;
- card setup, :meth:`set_up_cards`, writes the nova-compute drop-in for the host's new modes, restarts
  nova-compute, waits until Placement shows the expected inventory, then marks every provider with its mode
  (traits) and puts the host in the per-mode aggregates;
- :meth:`sync_hardware` compares Placement's picture with the host's and fixes what gpumode owns (marks, stale
  providers nobody holds), reporting the rest;
- vGPU layouts come from Cyborg device profiles when Cyborg is configured, then from gpumode's own profiles.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from gpumode.cloud.base import (
    Card,
    CardCounts,
    CardSpec,
    CardStatus,
    CloudHostSteps,
    CloudUnavailable,
    Drift,
    PassthroughAlias,
    VgpuProfile,
)
from gpumode.cloud.embedded import EmbeddedPlatform
from gpumode.cloud.openstack.channel import NOVA_CONF, NodeChannel
from gpumode.cloud.openstack.compute import ComputeApi
from gpumode.cloud.openstack.config import OpenStackConfig
from gpumode.cloud.openstack.cyborg import ProfileSource
from gpumode.cloud.openstack.delivery import delivery_steps, predict
from gpumode.cloud.openstack.expect import Expectation, expectation, gpu_resource_class, provider_gpu
from gpumode.cloud.openstack.http import OpenStackError, ServiceError
from gpumode.cloud.openstack.marks import MarkResult, apply_marks
from gpumode.cloud.openstack.novaconf import RenderError, render_dropin
from gpumode.cloud.openstack.novamerge import NovaConfigError, merge, problems, reading_order
from gpumode.cloud.openstack.placement import PlacementClient, Provider
from gpumode.cloud.openstack.switch import Hold, Waiter, hold_host, release_host
from gpumode.domain import HostSnapshot, Mode, Plan, VmPolicy

log = logging.getLogger(__name__)

# Aggregate uuids when Nova is not driven (deterministic, so every server process agrees).
AGGREGATE_NAMESPACE = uuid.UUID("6f0c5c2e-3f1e-4d0a-9a53-6770756d6f64")
MARKED_MODES = (Mode.ACCEL, Mode.VGPU, Mode.PASSTHROUGH)


def aggregate_name(mode: Mode) -> str:
    return f"gpumode-{mode.value}"


@dataclass(frozen=True, slots=True)
class OpenStackClients:
    """The services a platform talks to; built once per server (see :func:`build_clients`)."""

    placement: PlacementClient
    compute: ComputeApi | None = None
    profiles: ProfileSource | None = None
    channel: NodeChannel | None = None


class OpenStackPlatform:
    """:class:`~gpumode.cloud.base.CloudPlatform` backed by OpenStack, plus the switch hooks above."""

    def __init__(
        self,
        session: Session,
        config: OpenStackConfig,
        clients: OpenStackClients,
        *,
        sleep: Callable[[float], None] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.embedded = EmbeddedPlatform(session)
        self.config = config
        self.clients = clients
        self.placement = clients.placement
        self._sleep, self._clock = sleep, clock

    def waiter(self, timeout_s: float) -> Waiter:
        waiter = Waiter(timeout_s, self.config.poll_interval_s)
        if self._sleep is not None:
            waiter.sleep = self._sleep
        if self._clock is not None:
            waiter.clock = self._clock
        return waiter

    # --- CloudPlatform: cards, aliases and gpumode's own profiles stay in the database
    # -----------------------

    def list_cards(
        self, *, node: str | None = None, status: CardStatus | None = None, kind: Mode | None = None
    ) -> list[Card]:
        return self.embedded.list_cards(node=node, status=status, kind=kind)

    def get_card(self, card_id: int) -> Card | None:
        return self.embedded.get_card(card_id)

    def register_cards(self, specs: Sequence[CardSpec]) -> list[Card]:
        return self.embedded.register_cards(specs)

    def remove_cards(self, card_ids: Sequence[int]) -> None:
        self.embedded.remove_cards(card_ids)

    def update_card(
        self,
        card_id: int,
        *,
        status: CardStatus | None = None,
        holder: str | None = None,
        clear_holder: bool = False,
    ) -> Card:
        return self.embedded.update_card(card_id, status=status, holder=holder, clear_holder=clear_holder)

    def count_cards(self, nodes: Sequence[str] = ()) -> CardCounts:
        """Counted in gpumode's database, where this platform keeps its cards (above). Placement's usages
        are per provider and in resource classes, not cards: summing them would cost a call per host and
        still not say which cards are free or lost."""
        return self.embedded.count_cards(nodes)

    def list_profiles(self) -> list[VgpuProfile]:
        """Cyborg's vGPU device profiles first; gpumode's own fill in names Cyborg does not have.

        Cyborg configured but failing is an error, not a silent fallback: a job must not carve another layout
        than the one the users registered.
        """
        own = self.embedded.list_profiles()
        if self.clients.profiles is None:
            return own
        try:
            users = self.clients.profiles.vgpu_profiles()
        except ServiceError as exc:
            raise OpenStackError(f"cannot read vGPU layouts from Cyborg: {exc}") from exc
        names = {p.name for p in users}
        return sorted(users + [p for p in own if p.name not in names], key=lambda p: p.name)

    def put_profile(self, profile: VgpuProfile) -> VgpuProfile:
        return self.embedded.put_profile(profile)

    def delete_profile(self, name: str) -> None:
        self.embedded.delete_profile(name)

    def list_aliases(self) -> list[PassthroughAlias]:
        return self.embedded.list_aliases()

    def put_alias(self, alias: PassthroughAlias) -> PassthroughAlias:
        return self.embedded.put_alias(alias)

    def delete_alias(self, name: str) -> None:
        self.embedded.delete_alias(name)

    # --- switch hooks -------------------------------------------------------------------------------------

    @property
    def ready_timeout_s(self) -> float:
        return self.config.inventory_timeout_s

    @property
    def retry_timeout_s(self) -> float:
        return self.config.placement_retry_s

    @property
    def retry_interval_s(self) -> float:
        return self.config.poll_interval_s

    def ready(self) -> str | None:
        """Can Placement be used now? One cheap authenticated read; None when it answered."""
        try:
            self.placement.client.call("GET", "/traits?name=startswith:CUSTOM_GPUMODE_")
        except ServiceError as exc:
            return f"Placement is not usable: {exc}"
        return None

    def host_steps(self, plan: Plan, snapshot: HostSnapshot) -> CloudHostSteps:
        """Deliver the drop-in for the host as the plan leaves it, and restart nova-compute (see
        :mod:`.delivery`). Refuses a plan nova cannot be configured for, naming the GPU."""
        try:
            dropin = self.render(predict(plan, snapshot), alias=plan.request.passthrough_alias)
        except RenderError as exc:
            raise OpenStackError(f"nova-compute cannot be configured for this switch: {exc}") from exc
        return delivery_steps(
            dropin_path=self.config.nova_dropin, dropin=dropin, restart=list(self.config.restart_command)
        )

    def before_switch(self, node: str, *, job: str, policy: VmPolicy) -> dict[str, Any]:
        """Take the host out of Nova's scheduling and apply the VM policy; returns the hold to store with the
        job (``{}`` when Nova is not driven)."""
        if self.clients.compute is None:
            return {}
        waiter = self.waiter(self.config.vm_timeout_s)
        return hold_host(
            self.clients.compute, self.config, node, job=job, policy=policy, waiter=waiter
        ).to_dict()

    def after_switch(self, hold: Mapping[str, Any], *, succeeded: bool) -> list[str]:
        """Undo :meth:`before_switch` (instances only after a failed switch); returns what could not be
        undone."""
        if not hold or self.clients.compute is None:
            return []
        waiter = self.waiter(self.config.vm_timeout_s)
        return release_host(
            self.clients.compute, Hold.from_dict(dict(hold)), succeeded=succeeded, waiter=waiter
        )

    def render(self, snapshot: HostSnapshot, *, alias: str | None = None) -> str:
        """The nova-compute drop-in for the host as the snapshot shows it."""
        aliases = {(a.vendor_id, a.product_id): a.name for a in self.list_aliases()}
        if alias:
            for gpu in snapshot.gpus:
                if gpu.mode is Mode.PASSTHROUGH:
                    fn = snapshot.function(gpu.address)
                    aliases[(fn.vendor if fn else 0x10DE, gpu.device)] = alias
        return render_dropin(snapshot, aliases=aliases, pci_in_placement=self.config.pci_in_placement)

    def set_up_cards(
        self, snapshot: HostSnapshot, *, alias: str | None = None, delivered: bool = False, wait: bool = True
    ) -> str:
        """Card setup for the host's new modes (see the module doc). Placement is only written after it shows
        the expected inventory, and a failed marking is undone, so a failure leaves no half-written marks.

        ``delivered``: a switch job's host steps already wrote the drop-in and restarted nova-compute
        (:meth:`host_steps`); otherwise they go through the configured :class:`NodeChannel`.
        ``wait=False`` (a switch job, which tries again itself): one look instead of polling up to
        ``inventory_timeout_s``; Placement away, erroring (5xx, 409) or not showing the inventory yet raises
        :class:`CloudUnavailable`.
        """
        node = snapshot.hostname
        if not delivered:
            self._deliver(snapshot, alias)
        expect = expectation(snapshot, pci_in_placement=self.config.pci_in_placement)
        if wait:
            self.waiter(self.config.inventory_timeout_s).until(
                f"Placement to show {node}'s GPU inventory", lambda: self.inventory_missing(expect)
            )
            deleted = self.clear_stale(snapshot, expect)
            marks = self.mark(expect)
        else:
            deleted, marks = self._mark_once(snapshot, expect)
        gone = f"; deleted stale GPU provider(s) {', '.join(deleted)}" if deleted else ""
        return f"nova-compute configured and restarted; {marks.summary()}{gone}"

    def clear_stale(self, snapshot: HostSnapshot, expect: Expectation) -> list[str]:
        """Delete the GPU providers the host's modes no longer call for, which nova-compute leaves behind (the
        libvirt driver returns early when no GPU has vGPU inventory, so a GPU that left vgpu keeps its
        provider and its ``VGPU`` inventory); returns their names. A switch is not done while Placement
        offers what the host no longer has: a stale provider someone holds allocations on raises
        :class:`StaleProviderHeld` (nothing deleted), as does a PCI provider nova reports for a passthrough
        GPU while gpumode's ``pci_in_placement`` is off (the two configurations disagree)."""
        root = self.placement.provider_by_name(expect.host)
        if root is None:
            return []
        stale: list[Provider] = []
        problems: list[str] = []
        for provider in self.placement.tree(root.uuid):
            if provider.parent_uuid is None or expect.provider(provider.name) is not None:
                continue
            try:
                owner = self._gpu_provider(provider, snapshot)
                held = self.placement.allocations(provider.uuid) if owner is not None else {}
            except ServiceError as exc:
                if exc.status == 404:  # nova-compute removed it meanwhile: nothing to clear
                    continue
                raise
            if owner is None:
                continue
            address, kind = owner
            gpu = snapshot.gpu(address)
            if kind is Mode.PASSTHROUGH and gpu is not None and gpu.mode is Mode.PASSTHROUGH:
                problems.append(
                    f"nova-compute reports GPU {address} in Placement ({provider.name}) but gpumode's "
                    "pci_in_placement is off: set [openstack] pci_in_placement = true to match nova's "
                    "[pci] report_in_placement"
                )
                continue
            if kind is Mode.VGPU and gpu is not None and gpu.mode is Mode.VGPU:
                continue  # a parent of a vGPU GPU that nova reports and gpumode did not configure: nova's own
            if held:
                problems.append(
                    f"GPU {address} left {kind.value} but consumer(s) {', '.join(sorted(held))} still hold "
                    f"allocations on its provider {provider.name}"
                )
                continue
            stale.append(provider)
        if problems:
            log.error("Placement cannot match %s's GPU modes: %s", expect.host, "; ".join(problems))
            raise StaleProviderHeld(
                f"Placement cannot show {expect.host}'s GPUs as their modes say: {'; '.join(problems)}"
            )
        deleted = []
        for provider in stale:
            try:
                self.placement.delete_provider(provider.uuid)
            except ServiceError as exc:
                if exc.status != 404:
                    raise
            deleted.append(provider.name)
        return deleted

    def _gpu_provider(self, provider: Provider, snapshot: HostSnapshot) -> tuple[str, Mode] | None:
        """:func:`provider_gpu`, and for a PCI provider its inventory too: a GPU's is in its own resource
        class."""
        owner = provider_gpu(snapshot, provider.name)
        if owner is None or owner[1] is not Mode.PASSTHROUGH:
            return owner
        classes = set(self.placement.inventories(provider.uuid))
        return owner if classes <= {gpu_resource_class(snapshot, owner[0])} else None

    def _mark_once(self, snapshot: HostSnapshot, expect: Expectation) -> tuple[list[str], MarkResult]:
        """One try at :meth:`set_up_cards`' Placement half; a failure that may pass raises
        :class:`CloudUnavailable` naming the service, where it is and the cause."""
        try:
            missing = self.inventory_missing(expect)
            if missing is not None:
                raise CloudUnavailable(
                    f"waiting for Placement at {self.placement_url()} to show {expect.host}'s GPU inventory: "
                    f"{missing}"
                )
            deleted = self.clear_stale(snapshot, expect)
            return deleted, self.mark(expect)
        except OpenStackError as exc:
            cause = exc if isinstance(exc, ServiceError) else exc.__cause__
            if isinstance(cause, ServiceError) and transient(cause):
                where = (
                    self.placement_url()
                    if cause.service == "placement"
                    else (self.config.compute_endpoint or "its catalog endpoint")
                )
                raise CloudUnavailable(f"waiting for {_service_name(cause)} at {where}: {exc}") from exc
            raise

    def placement_url(self) -> str:
        """Where Placement is, for messages: the configured endpoint, else the catalog's."""
        if self.config.placement_endpoint:
            return self.config.placement_endpoint
        try:
            return str(self.placement.client.adapter.get_endpoint() or "its catalog endpoint")
        except Exception:  # the catalog itself is away; the message must still be made
            return "its catalog endpoint"

    def _deliver(self, snapshot: HostSnapshot, alias: str | None) -> None:
        node = snapshot.hostname
        channel = self.clients.channel
        if channel is None:
            raise OpenStackError("no channel to the hosts is configured: cannot deliver the nova drop-in")
        dropin = self.render(snapshot, alias=alias)
        self.check_merged(snapshot, dropin, channel.read_nova_config(node))
        channel.write_file(node, self.config.nova_dropin, dropin)
        result = channel.run(node, self.config.restart_command)
        if not result.ok:
            detail = (result.stderr or result.stdout).strip() or "no output"
            raise OpenStackError(
                f"restarting nova-compute on {node} failed (exit {result.returncode}): {detail}"
            )

    def check_merged(self, after: HostSnapshot, dropin: str, files: Mapping[str, str]) -> None:
        """Refuse (``OpenStackError``, nothing written) when the drop-in merged with the node's other nova
        files, as nova-compute reads them (:mod:`.novamerge`), would not give the GPUs the modes ``after``
        says; the message names each file and option at fault."""
        path = self.config.nova_dropin
        texts = {**files, path: dropin}
        conf = NOVA_CONF if NOVA_CONF in texts else None
        order = reading_order(conf, [p for p in texts if p != conf])
        try:
            found = problems(
                merge([(p, texts[p]) for p in order]),
                after,
                dropin=path,
                pci_in_placement=self.config.pci_in_placement,
            )
        except NovaConfigError as exc:
            found = [str(exc)]
        if found:
            raise OpenStackError(
                f"nova-compute on {after.hostname} would not give the GPUs their new modes: "
                + "; ".join(found)
            )

    def inventory_missing(self, expect: Expectation) -> str | None:
        """What Placement lacks of ``expect`` (None: all there). An unreachable Placement counts as
        lacking."""
        try:
            root = self.placement.provider_by_name(expect.host)
            if root is None:
                return f"no resource provider named {expect.host}"
            found = {p.name: p for p in self.placement.tree(root.uuid)}
            missing = []
            for want in expect.providers:
                provider = found.get(want.name)
                if provider is None:
                    missing.append(f"{want.name} absent")
                    continue
                total = int(
                    self.placement.inventories(provider.uuid).get(want.resource_class, {}).get("total", 0)
                )
                if total < want.min_total:
                    missing.append(
                        f"{want.name} has {total} {want.resource_class}, expected >= {want.min_total}"
                    )
            return "; ".join(missing) or None
        except ServiceError as exc:
            if exc.unreachable:
                return str(exc)
            raise

    def mark(self, expect: Expectation) -> MarkResult:
        root = self.placement.provider_by_name(expect.host)
        if root is None:
            raise OpenStackError(f"no resource provider named {expect.host} in Placement")
        tree = self.placement.tree(root.uuid)
        aggregates, undo_nova = self._nova_aggregates(expect.host, set(expect.root_modes))
        try:
            return apply_marks(self.placement, tree, expect, aggregates)
        except Exception:
            undo_nova()
            raise

    def _nova_aggregates(self, host: str, modes: set[Mode]) -> tuple[dict[Mode, str], Callable[[], None]]:
        """Per-mode aggregate uuids; with Nova, the host joins the ``gpumode-<mode>`` host aggregates of its
        modes and leaves the others. Returns the uuids and a function undoing the membership changes."""
        compute = self.clients.compute
        if compute is None:
            return {
                m: str(uuid.uuid5(AGGREGATE_NAMESPACE, aggregate_name(m))) for m in MARKED_MODES
            }, lambda: None
        existing = {a.name: a for a in compute.aggregates()}
        done: list[tuple[int, bool]] = []
        uuids: dict[Mode, str] = {}
        try:
            for mode in MARKED_MODES:
                agg = existing.get(aggregate_name(mode)) or compute.create_aggregate(aggregate_name(mode))
                uuids[mode] = agg.uuid
                if mode in modes and host not in agg.hosts:
                    compute.add_host(agg.id, host)
                    done.append((agg.id, True))
                elif mode not in modes and host in agg.hosts:
                    compute.remove_host(agg.id, host)
                    done.append((agg.id, False))
        except Exception:
            _undo_membership(compute, host, done)
            raise
        return uuids, lambda: _undo_membership(compute, host, done)

    # --- hardware sync ------------------------------------------------------------------------------------

    def sync_hardware(self, snapshot: HostSnapshot) -> list[Drift]:
        """Make Placement agree with the host where gpumode may; report what it cannot fix."""
        expect = expectation(snapshot, pci_in_placement=self.config.pci_in_placement)
        host = snapshot.hostname
        root = self.placement.provider_by_name(host)
        if root is None:
            return [
                Drift(
                    host, "no compute node resource provider in Placement (is nova-compute running?)", False
                )
            ]
        drift: list[Drift] = []
        missing = self.inventory_missing(expect)
        if missing:
            drift.append(Drift(host, f"Placement lacks GPU inventory: {missing}", False))
        tree = self.placement.tree(root.uuid)
        for provider in tree:
            owner = self._gpu_provider(provider, snapshot)
            if provider.parent_uuid is None or owner is None or expect.provider(provider.name) is not None:
                continue
            gpu = snapshot.gpu(owner[0])
            if gpu is not None and gpu.mode is owner[1]:
                if owner[1] is Mode.PASSTHROUGH:
                    drift.append(
                        Drift(
                            provider.name,
                            f"nova-compute reports GPU {owner[0]} in Placement but gpumode's "
                            "pci_in_placement is off; kept",
                            False,
                        )
                    )
                continue  # the GPU is in the provider's mode: nova's to report, not stale
            drift.append(self._stale(provider))
        marks = self.mark(expect)
        drift += [
            Drift(c.provider.name, f"{c.kind} were {sorted(c.before)}, set to {sorted(c.after)}", True)
            for c in marks.changes
        ]
        return drift

    def _stale(self, provider: Provider) -> Drift:
        """A GPU provider the host's modes no longer call for: deleted unless a consumer still holds it."""
        held = self.placement.allocations(provider.uuid)
        if held:
            consumers = ", ".join(sorted(held))
            return Drift(
                provider.name,
                f"its GPU left this mode but consumer(s) {consumers} still hold allocations; kept",
                False,
            )
        self.placement.delete_provider(provider.uuid)
        return Drift(provider.name, "stale GPU provider with no allocations; deleted", True)


def transient(error: ServiceError) -> bool:
    """A failure that may pass by itself: unreachable, a timeout, a 5xx, or a generation conflict (409)."""
    return error.unreachable or error.status == 409


def _service_name(error: ServiceError) -> str:
    return {"placement": "Placement", "nova": "Nova", "cyborg": "Cyborg"}.get(error.service, error.service)


class StaleProviderHeld(OpenStackError):
    """Placement would still offer a GPU in a mode it left (or the two PCI settings disagree): the switch is
    not done. Permanent: it does not pass by waiting."""


def _undo_membership(compute: ComputeApi, host: str, done: list[tuple[int, bool]]) -> None:
    for agg_id, added in reversed(done):
        try:
            if added:
                compute.remove_host(agg_id, host)
            else:
                compute.add_host(agg_id, host)
        except OpenStackError as exc:
            log.error("could not undo aggregate %s membership of %s: %s", agg_id, host, exc)
