"""The mode engine's one door: plan, apply, resume, roll back, assert and report, on one host.

The local CLI and the agent both call it, so everything a caller needs is here and nothing here prints.
The sequence of an apply is what makes it safe:

1. With no unfinished journal, the request is planned (and so validated) *before* anything is written: a bad
   request leaves the host's files byte for byte as they were.
2. The host lock is taken (one runner per host), then an unfinished journal is finished, or undone when asked.
3. The request is planned again from a fresh discovery (the host may have changed meanwhile) and run under a
   new journal; on success the desired state of its GPUs is written.

Operator configuration lives on the host: ``<root>/etc/gpumode/catalog.yaml`` and ``whitelist.yaml`` replace
the built-in catalog and the default whitelist when present (or pass paths in :class:`EngineConfig`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpumode.domain import (
    HostSnapshot,
    Mode,
    Plan,
    SwitchRequest,
    VmPolicy,
)
from gpumode.errors import GpumodeError
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.host.vms import NO_HYPERVISOR_NOTE, Hypervisor, HypervisorUnavailable, open_hypervisor
from gpumode.modes import verify
from gpumode.modes.catalog import Catalog, load_catalog
from gpumode.modes.desired import (
    DesiredState,
    GpuDesire,
    load_desired,
    plan_gpus,
    record_success,
    undo_success,
)
from gpumode.modes.journal import HostLock, Journal, JournalStore, RunState
from gpumode.modes.plan import plan_switch
from gpumode.modes.policy import RequestError, Whitelist, load_whitelist, parse_address
from gpumode.modes.run import ProgressCallback, Runner, RunResult, Verifier


class EngineError(GpumodeError, RuntimeError):
    """The engine cannot go on (an unfinished journal it could not finish, a stale plan); says what to do."""

    default_code = "unsettled_run"


@dataclass(slots=True)
class EngineConfig:
    """Where the operator's catalog and whitelist are; ``None``: the host's ``etc/gpumode`` file or the
    default."""

    catalog: str | Path | None = None
    whitelist: str | Path | None = None
    host_group: str | None = None
    # plan without VMs when no hypervisor is found (the plan says so); otherwise that is an error
    without_hypervisor: bool = False

    def load(self, host: Host) -> tuple[Catalog, Whitelist]:
        catalog = self.catalog or _host_file(host, "catalog.yaml")
        whitelist = self.whitelist or _host_file(host, "whitelist.yaml")
        return load_catalog(catalog), load_whitelist(whitelist)


def _host_file(host: Host, name: str) -> Path | None:
    path = host.path("etc/gpumode", name)
    return path if path.is_file() else None


@dataclass(slots=True)
class ApplyResult:
    """What an apply did: the unfinished run it settled first (if any), then its own plan and run."""

    plan: Plan | None
    run: RunResult | None
    previous: RunResult | None = None
    discovery_s: float = 0.0  # time spent discovering the host (the bench reports it)

    @property
    def ok(self) -> bool:
        prev_ok = self.previous is None or self.previous.state.finished
        return prev_ok and (self.run is None or self.run.ok)


# --- planning -----------------------------------------------------------------------------------------------


def plan(
    host: Host,
    request: SwitchRequest,
    *,
    config: EngineConfig | None = None,
    snapshot: HostSnapshot | None = None,
    hypervisor: Hypervisor | None = None,
) -> Plan:
    """Plan ``request`` on the host as it is now. Reads only; raises ``RequestError`` / ``ConfigError``."""
    config = config or EngineConfig()
    catalog, whitelist = config.load(host)
    hv = hypervisor or open_hypervisor(host)
    snapshot = snapshot or discover(host)
    request = replace(request, gpus=_canonical_gpus(snapshot, request.gpus))
    note = None
    try:
        vms = hv.list_vms()
    except HypervisorUnavailable as exc:
        if not config.without_hypervisor:
            raise
        vms, note = [], f"{NO_HYPERVISOR_NOTE} ({exc})"
    the_plan = plan_switch(
        snapshot, vms, request, catalog=catalog, whitelist=whitelist, host_group=config.host_group
    )
    if note is not None:
        the_plan.impact.notes.append(note)
    return the_plan


def _canonical_gpus(snapshot: HostSnapshot, gpus: list[str]) -> list[str]:
    """Canonical addresses of the requested GPUs; an address that is malformed or not a GPU here is
    refused."""
    out = []
    for text in gpus:
        address = parse_address(text)
        if snapshot.gpu(address) is None:
            raise RequestError(
                "unknown_gpu",
                f"no GPU {address} on host {snapshot.hostname}",
                [g.address for g in snapshot.gpus],
            )
        out.append(address)
    return out


def new_plan_id(plan: Plan) -> str:
    """Sortable by time, unique per run: ``20250101T120000Z-1a2b3c4d``."""
    body = json.dumps(plan.to_dict(), sort_keys=True, default=str) + str(time.time_ns())
    return (
        time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + hashlib.sha256(body.encode()).hexdigest()[:8]
    )


# --- running ------------------------------------------------------------------------------------------------


def apply(
    host: Host,
    target: SwitchRequest | Plan,
    progress: ProgressCallback | None = None,
    *,
    rollback_on_failure: bool = True,
    rollback_unfinished: bool = False,
    config: EngineConfig | None = None,
    hypervisor: Hypervisor | None = None,
) -> ApplyResult:
    """Switch the host as ``target`` says (a request, planned here, or a ready plan, e.g. a server job's).

    An unfinished journal is settled first: resumed, or undone with ``rollback_unfinished``. A failing step
    rolls this plan back unless ``rollback_on_failure`` is false (the host then stays where it stopped, and
    the journal stays unfinished for ``resume``/``rollback``).
    """
    config = config or EngineConfig()
    hv = hypervisor or open_hypervisor(host)
    store = JournalStore(host)
    discovery_s = 0.0
    if store.unfinished() is None:
        # validate before taking the lock: a bad request must not leave even a lock file behind
        t = time.perf_counter()
        first = _plan_target(host, target, config, hv)
        discovery_s += time.perf_counter() - t
    else:
        first = None
    with HostLock(host):
        previous = _settle(host, store, progress, hv, rollback=rollback_unfinished)
        t = time.perf_counter()
        current = first if first is not None and previous is None else _plan_target(host, target, config, hv)
        discovery_s += time.perf_counter() - t
        journal = store.create(current, new_plan_id(current))
        result = Runner(host, progress=progress, hypervisor=hv, verify=_verifier(host, config)).run(
            journal, rollback_on_failure=rollback_on_failure
        )
        _record(host, journal, result)
    return ApplyResult(plan=current, run=result, previous=previous, discovery_s=discovery_s)


def _plan_target(host: Host, target: SwitchRequest | Plan, config: EngineConfig, hv: Hypervisor) -> Plan:
    if isinstance(target, SwitchRequest):
        return plan(host, target, config=config, hypervisor=hv)
    snapshot = discover(host)
    if target.hostname and snapshot.hostname and target.hostname != snapshot.hostname:
        raise EngineError(f"plan is for host {target.hostname!r}, this is {snapshot.hostname!r}")
    if target.snapshot_fingerprint and target.snapshot_fingerprint != snapshot.fingerprint:
        raise EngineError(
            "the host changed since this plan was made (snapshot fingerprint differs): plan it again"
        )
    return target


def _settle(
    host: Host, store: JournalStore, progress: ProgressCallback | None, hv: Hypervisor, *, rollback: bool
) -> RunResult | None:
    """Finish (or undo) an unfinished journal; the caller holds the lock. Raises if it cannot be settled."""
    journal = store.unfinished()
    if journal is None:
        return None
    runner = Runner(host, progress=progress, hypervisor=hv, verify=_verifier(host, None))
    result = runner.rollback(journal) if rollback else runner.run(journal)
    _record(host, journal, result)
    if not result.state.finished:
        raise EngineError(
            f"the unfinished run {journal.plan_id} could not be settled "
            f"({result.error or result.state.value}); fix the cause, then `gpumode resume` or "
            "`gpumode rollback`; `gpumode journal show` compares the host with both, "
            "`gpumode journal abandon --yes` gives the run up"
        )
    return result


def _record(host: Host, journal: Journal, result: RunResult) -> None:
    if result.ok:
        record_success(host, journal.plan.request, plan_gpus(journal.plan), journal.plan_id)


def resume(
    host: Host,
    progress: ProgressCallback | None = None,
    *,
    rollback_on_failure: bool = True,
    hypervisor: Hypervisor | None = None,
) -> RunResult | None:
    """Finish the unfinished journal, if any (a failing step then rolls it back unless told not to)."""
    store = JournalStore(host)
    if store.unfinished() is None:
        return None
    with HostLock(host):
        journal = store.unfinished()
        if journal is None:
            return None
        runner = Runner(host, progress=progress, hypervisor=hypervisor, verify=_verifier(host, None))
        result = runner.run(journal, rollback_on_failure=rollback_on_failure)
        _record(host, journal, result)
        return result


def rollback(
    host: Host, progress: ProgressCallback | None = None, *, hypervisor: Hypervisor | None = None
) -> RunResult | None:
    """Undo the unfinished journal, if any, newest step first."""
    store = JournalStore(host)
    if store.unfinished() is None:
        return None
    with HostLock(host):
        journal = store.unfinished()
        if journal is None:
            return None
        return Runner(host, progress=progress, hypervisor=hypervisor, verify=_verifier(host, None)).rollback(
            journal
        )


def undo_finished(
    host: Host,
    plan_id: str,
    progress: ProgressCallback | None = None,
    *,
    hypervisor: Hypervisor | None = None,
) -> RunResult:
    """Undo a run that finished ``done`` (the server's cloud side failed after it): every step it did,
    newest first, from the undo records its journal kept; the GPUs' desired state goes back too.

    Crash-safe and repeatable: the journal is reopened (rolling back) before anything is undone, so a crash
    leaves an unfinished rolling_back journal that :func:`rollback` or :func:`resume` finishes; a run already
    undone is returned as it is.
    """
    store = JournalStore(host)
    with HostLock(host):
        runner = Runner(host, progress=progress, hypervisor=hypervisor, verify=_verifier(host, None))
        unfinished = store.unfinished()
        if unfinished is not None:
            if unfinished.plan_id != plan_id:
                raise EngineError(
                    f"cannot undo run {plan_id}: run {unfinished.plan_id} is unfinished on this host; "
                    "settle it first (`gpumode resume` or `gpumode rollback`)"
                )
            undo_success(host, plan_id)
            return runner.rollback(unfinished)  # an undo a crash interrupted
        journal = store.finished(plan_id)
        if journal is None:
            raise EngineError(f"no finished run {plan_id} on this host to undo")
        if journal.state is RunState.ROLLED_BACK:
            return RunResult(journal.plan_id, journal.state, journal.path, journal.steps, journal.error)
        if journal.state is not RunState.DONE:
            raise EngineError(f"run {plan_id} ended {journal.state.value}; only a done run can be undone")
        undo_success(host, plan_id)
        return runner.rollback(store.reopen(journal, "undoing a finished run"))


def apply_desired(
    host: Host,
    progress: ProgressCallback | None = None,
    *,
    vm_policy: VmPolicy = VmPolicy.GPU,
    rollback_on_failure: bool = True,
    config: EngineConfig | None = None,
    hypervisor: Hypervisor | None = None,
) -> list[ApplyResult]:
    """Bring every GPU back to its desired mode (at boot), one plan per group of GPUs that want the same.

    Each group is planned from a fresh discovery, so what a reboot lost (VFs, vGPU types, vfio bindings) comes
    back. Stops at the first group that fails.
    """
    desired = load_desired(host)
    results: list[ApplyResult] = []
    for request in desired.requests(vm_policy):
        result = apply(
            host,
            request,
            progress,
            rollback_on_failure=rollback_on_failure,
            config=config,
            hypervisor=hypervisor,
        )
        results.append(result)
        if not result.ok:
            break
    return results


# --- asserting and reporting --------------------------------------------------------------------------------


def assert_mode(
    host: Host,
    mode: Mode,
    gpus: list[str] | None = None,
    *,
    vgpu_type: str | None = None,
    vgpu_count: int | None = None,
    snapshot: HostSnapshot | None = None,
    config: EngineConfig | None = None,
) -> list[str]:
    """What keeps the host (or ``gpus``) from being in ``mode`` (with that vGPU type and count); empty when
    it is. The checks are :mod:`gpumode.modes.verify`'s; a host without GPUs is in no mode."""
    snapshot = snapshot or discover(host)
    addresses = _canonical_gpus(snapshot, gpus) if gpus else [g.address for g in snapshot.gpus]
    catalog, _ = (config or EngineConfig()).load(host)
    want = verify.Want(mode, vgpu_type, vgpu_count)
    return verify.differences(host, snapshot, dict.fromkeys(addresses, want), catalog)


def _verifier(host: Host, config: EngineConfig | None) -> Verifier:
    """A run is done, a rollback rolled back, only if the host then asserts the state it claims."""

    def check(journal: Journal, rolled_back: bool) -> list[str]:
        wants = verify.plan_wants(journal.plan, rolled_back=rolled_back)
        if not wants:
            return []  # a plan for no GPU (a cloud-only change) claims nothing about the host
        catalog, _ = (config or EngineConfig()).load(host)
        return verify.differences(host, discover(host), wants, catalog)

    return check


@dataclass(slots=True)
class JournalCheck:
    """An unfinished run and how far the host is from either way out of it."""

    journal: Journal
    to_target: list[str]  # what keeps the host from the run's target (what resume must still do)
    to_previous: list[str]  # what keeps it from the state before the run (what rollback must still do)


def check_unfinished(host: Host, *, config: EngineConfig | None = None) -> JournalCheck | None:
    """The unfinished run, if any, with the host compared to its target and to the state before it. Reads
    only."""
    journal = JournalStore(host).unfinished()
    if journal is None:
        return None
    snapshot = discover(host)
    catalog, _ = (config or EngineConfig()).load(host)

    def far(rolled_back: bool) -> list[str]:
        wants = verify.plan_wants(journal.plan, rolled_back=rolled_back)
        return verify.differences(host, snapshot, wants, catalog) if wants else []

    return JournalCheck(journal, far(False), far(True))


def abandon(host: Host, why: str) -> Journal:
    """Give up on the unfinished run: its journal goes to ``done/`` as ``abandoned`` with ``why``, the host
    stays exactly as it is, and the next apply plans from what discovery then shows. The way out for a run
    that cannot settle (a device that needs a reboot or a hand); the caller shows the host's state first."""
    store = JournalStore(host)
    with HostLock(host):
        journal = store.unfinished()
        if journal is None:
            raise EngineError("no unfinished run on this host to abandon")
        was = journal.state.value
        journal.state = RunState.ABANDONED
        said = f" (it said: {journal.error})" if journal.error else ""
        journal.error = f"abandoned while {was}: {why}{said}"
        journal.save()
        store.archive(journal)
    return journal


@dataclass(slots=True)
class GpuStatus:
    address: str
    name: str
    mode: Mode
    driver: str | None
    desired: GpuDesire | None
    companions: dict[str, str | None] = field(default_factory=dict)  # address -> driver
    vgpus: int = 0  # mdevs + vendor vGPU VFs

    @property
    def converged(self) -> bool:
        return self.desired is None or self.desired.mode is self.mode


@dataclass(slots=True)
class HostStatus:
    hostname: str
    driver_state: str
    gpus: list[GpuStatus]
    desired: DesiredState
    unfinished: Journal | None
    last: Journal | None
    problems: list[str]


def status(host: Host) -> HostStatus:
    """Current and desired mode per GPU, any unfinished journal, the last finished run. Reads only."""
    snapshot = discover(host)
    desired = load_desired(host)
    store = JournalStore(host)
    history = store.history(limit=1)
    gpus = [
        GpuStatus(
            address=g.address,
            name=g.name,
            mode=g.mode,
            driver=g.driver,
            desired=desired.gpus.get(g.address),
            companions={c: fn.driver for c in g.companions if (fn := snapshot.function(c)) is not None},
            vgpus=len(g.mdevs) + len(g.vgpus),
        )
        for g in snapshot.gpus
    ]
    return HostStatus(
        hostname=snapshot.hostname,
        driver_state=snapshot.driver_state.value,
        gpus=gpus,
        desired=desired,
        unfinished=store.unfinished(),
        last=history[-1] if history else None,
        problems=list(snapshot.problems),
    )


__all__ = [
    "ApplyResult",
    "EngineConfig",
    "EngineError",
    "HostStatus",
    "JournalCheck",
    "RunState",
    "abandon",
    "apply",
    "apply_desired",
    "assert_mode",
    "check_unfinished",
    "plan",
    "resume",
    "rollback",
    "status",
]
