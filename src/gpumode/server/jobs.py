"""Switch jobs (method steps 3–7) on the server: plan from what the node reported, store, hand to the agent,
fold its step reports in, run the cloud steps, end.

A job is the stored :class:`~gpumode.domain.Plan` plus the progress of each of its steps. Everything lives in
the database, so a restarted server carries on where it was: the agent retries its reports, and
:func:`recover` finishes the cloud steps of jobs whose host part ended while the server was away.

One active (``queued``/``running``) job per node is enforced by a partial unique index (see
:class:`~gpumode.server.models.Job`), not by a read-then-write check, so it holds with several server
processes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpumode.cloud.base import (
    CardStatus,
    CloudError,
    CloudHostSteps,
    CloudPlatform,
    PassthroughAlias,
    SwitchHooks,
    cards_for_snapshot,
)
from gpumode.domain import HostSnapshot, Mode, Plan, SwitchRequest, VmPolicy
from gpumode.host.vms import Vm, VmDevice
from gpumode.modes import policy
from gpumode.modes.catalog import Catalog, load_catalog
from gpumode.modes.plan import plan_switch
from gpumode.server import sync
from gpumode.server.models import Event, HostGroup, Job, Node
from gpumode.server.schemas import Whitelist

log = logging.getLogger(__name__)


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"
    CANCELLED = "cancelled"

    @property
    def active(self) -> bool:
        return self in (JobState.QUEUED, JobState.RUNNING)


class HostState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


class StepState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    UNDONE = "undone"


class JobError(ValueError):
    """A switch cannot be made a job; ``code`` is stable (the policy's codes, plus a few of ours)."""

    def __init__(self, code: str, message: str, choices: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.choices = list(choices)

    def detail(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "choices": self.choices}


class NotFound(LookupError):
    """A node, profile or alias the request names does not exist."""


class ActiveJobExists(RuntimeError):
    """The node already has a queued or running job."""

    def __init__(self, node: str, job_id: int | None) -> None:
        what = f"job {job_id}" if job_id is not None else "another job"
        super().__init__(f"node {node} already has an active switch ({what}); wait for it or cancel it")
        self.job_id = job_id


class JobConflict(RuntimeError):
    """The job is not in a state that allows this (e.g. cancelling a finished job)."""


# --- requests and planning ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SwitchOptions:
    """A switch request as the API receives it (before profiles are looked up)."""

    mode: Mode
    gpus: tuple[str, ...] = ()
    vgpu_type: str | None = None
    vgpu_count: int | None = None
    profile: str | None = None
    passthrough_alias: str | None = None
    vm_policy: VmPolicy = VmPolicy.GPU


def to_request(options: SwitchOptions, platform: CloudPlatform) -> SwitchRequest:
    """The engine's :class:`SwitchRequest`; a profile becomes its vGPU type and count, an alias must exist."""
    vgpu_type, vgpu_count = options.vgpu_type, options.vgpu_count
    if options.profile is not None:
        if options.mode is not Mode.VGPU:
            raise JobError("invalid_option", f"profile only applies to mode vgpu, not {options.mode.value}")
        if vgpu_type is not None or vgpu_count is not None:
            raise JobError("invalid_option", "give either a profile or vgpu_type/vgpu_count, not both")
        profiles = {p.name: p for p in platform.list_profiles()}
        found = profiles.get(options.profile)
        if found is None:
            raise JobError("unknown_profile", f"no vGPU profile named {options.profile!r}", sorted(profiles))
        vgpu_type, vgpu_count = found.vgpu_type, found.count_per_gpu
    if options.passthrough_alias is not None:
        aliases = sorted(a.name for a in platform.list_aliases())
        if options.passthrough_alias not in aliases:
            raise JobError(
                "unknown_alias", f"no passthrough alias named {options.passthrough_alias!r}", aliases
            )
    return SwitchRequest(
        mode=options.mode,
        gpus=list(options.gpus),
        vgpu_type=vgpu_type,
        vgpu_count=vgpu_count,
        passthrough_alias=options.passthrough_alias,
        vm_policy=options.vm_policy,
    )


def policy_whitelist(stored: Whitelist) -> policy.Whitelist:
    """The stored whitelist in the engine's terms. Groups match by name only (the server knows members)."""
    models: dict[int, frozenset[Mode]] = {}
    for key, modes in stored.models.items():
        vendor, device = key.split(":")
        if vendor == "10de":  # the planner only switches NVIDIA GPUs; other vendors' rules cannot apply
            models[int(device, 16)] = frozenset(modes)
    return policy.Whitelist(
        source="the server's whitelist (GET /api/v1/modes)",
        platform=frozenset(stored.platform),
        groups=tuple(policy.HostGroup(name, (), frozenset(m)) for name, m in stored.groups.items()),
        models=models,
    )


def stored_vms(node: Node) -> list[Vm]:
    return [
        Vm(v["name"], v["uuid"], v["running"], [VmDevice(d["kind"], d["id"]) for d in v.get("devices", [])])
        for v in node.vms or []
    ]


def store_vms(session: Session, name: str, vms: list[dict[str, Any]]) -> bool:
    """Keep the VMs a node reported; ``True`` when they differ from those stored (the caller commits)."""
    node = session.scalars(select(Node).where(Node.name == name)).first()
    if node is None or node.vms == vms:
        return False
    node.vms = vms
    return True


def catalog() -> Catalog:
    """The built-in catalog (GPU models, vGPU types, driver flavours); ``load_catalog`` caches its parse."""
    return load_catalog(None)


def plan_for_node(
    session: Session,
    node: Node,
    request: SwitchRequest,
    whitelist: Whitelist,
    platform: CloudPlatform | None = None,
) -> Plan:
    """Plan ``request`` on the node as it last reported itself; :class:`JobError` when it may not run.

    With ``platform``, the host steps it asks for (:meth:`SwitchHooks.host_steps`, e.g. delivering
    nova-compute's configuration) are part of the plan, so a dry run shows exactly what a job runs.
    """
    group = session.scalar(select(HostGroup.name).where(HostGroup.id == node.group_id))
    snapshot = HostSnapshot.from_dict(node.snapshot)
    rules = policy_whitelist(whitelist)
    try:
        plan = plan_switch(
            snapshot,
            stored_vms(node),
            request,
            catalog=catalog(),
            whitelist=rules,
            host_group=group if group in whitelist.groups else None,
        )
    except policy.RequestError as exc:
        raise JobError(exc.code, exc.message, exc.choices) from exc
    hooks = switch_hooks(platform)
    if hooks is None:
        return plan
    try:
        extra = hooks.host_steps(plan, snapshot)
    except CloudError as exc:
        raise JobError("cloud_refused", str(exc)) from exc
    return with_host_steps(plan, extra)


def switch_hooks(platform: CloudPlatform | None) -> SwitchHooks | None:
    """The platform's switch hooks, when it has them."""
    return platform if isinstance(platform, SwitchHooks) else None


def with_host_steps(plan: Plan, extra: CloudHostSteps) -> Plan:
    """``plan`` with a platform's host steps: ``first`` before every host step, ``last`` after them and
    before the cloud steps; ids renumbered (``NN-action-target``) so they stay unique and ordered."""
    if not extra.first and not extra.last:
        return plan
    host = [s for s in plan.steps if s.where == "host"]
    cloud = [s for s in plan.steps if s.where != "host"]
    ordered = [*extra.first, *host, *extra.last, *cloud]
    steps = [replace(s, id=f"{i:02d}-{s.action}-{s.target}") for i, s in enumerate(ordered, start=1)]
    impact = replace(plan.impact, estimated_seconds=round(sum(s.estimate_s for s in steps), 3))
    return replace(plan, steps=steps, impact=impact)


def find_node(session: Session, name: str) -> Node:
    node = session.scalars(select(Node).where(Node.name == name)).first()
    if node is None:
        raise NotFound(f"no node named {name!r}")
    return node


# --- jobs ---------------------------------------------------------------------------------------------------


def now() -> datetime:
    return datetime.now(UTC)


def request_json(request: SwitchRequest) -> dict[str, Any]:
    return {
        "mode": request.mode.value,
        "gpus": list(request.gpus),
        "vgpu_type": request.vgpu_type,
        "vgpu_count": request.vgpu_count,
        "passthrough_alias": request.passthrough_alias,
        "vm_policy": request.vm_policy.value,
    }


def request_from_json(data: dict[str, Any]) -> SwitchRequest:
    return SwitchRequest(
        mode=Mode(data["mode"]),
        gpus=list(data.get("gpus") or []),
        vgpu_type=data.get("vgpu_type"),
        vgpu_count=data.get("vgpu_count"),
        passthrough_alias=data.get("passthrough_alias"),
        vm_policy=VmPolicy(data.get("vm_policy", VmPolicy.GPU.value)),
    )


def plan_json(plan: Plan) -> dict[str, Any]:
    """``Plan.to_dict()`` with JSON types (the impact's (before, after) tuples become lists)."""
    data = plan.to_dict()
    data["request"] = request_json(plan.request)
    data["impact"]["gpus"] = {a: [b.value, c.value] for a, (b, c) in plan.impact.gpus.items()}
    return data


def create_job(
    session: Session,
    node: Node,
    plan: Plan,
    *,
    created_by: str | None,
    rollout_id: int | None = None,
) -> Job:
    """Store a queued job (flushes). Raises :class:`ActiveJobExists`; the session is then rolled back to
    the savepoint, so the caller's other changes survive."""
    stamp = now()
    job = Job(
        node_id=node.id,
        node=node.name,
        state=JobState.QUEUED.value,
        host_state=HostState.PENDING.value,
        request=request_json(plan.request),
        plan=plan_json(plan),
        steps=[
            {
                "id": s.id,
                "action": s.action,
                "target": s.target,
                "where": s.where,
                "description": s.description,
                "state": StepState.PENDING.value,
                "started_at": None,
                "finished_at": None,
                "error": None,
                "note": None,
            }
            for s in plan.steps
        ],
        cancel_requested=False,
        rollout_id=rollout_id,
        created_by=created_by,
        created_at=stamp,
        updated_at=stamp,
    )
    # Cheap check first for a helpful answer; the unique index is what decides under concurrency.
    existing = active_job_id(session, node.id)
    if existing is not None:
        raise ActiveJobExists(node.name, existing)
    try:
        with session.begin_nested():
            session.add(job)
            session.flush()
    except IntegrityError as exc:
        raise ActiveJobExists(node.name, None) from exc
    return job


def active_job_id(session: Session, node_id: int) -> int | None:
    return session.scalar(
        select(Job.id).where(Job.node_id == node_id, Job.state.in_([s.value for s in JobState if s.active]))
    )


def get_job(session: Session, job_id: int, *, lock: bool = False) -> Job:
    query = select(Job).where(Job.id == job_id)
    job = session.scalars(query.with_for_update() if lock else query).first()
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def _finish(job: Job, state: JobState, error: str | None = None) -> None:
    job.state = state.value
    job.finished_at = job.updated_at = now()
    if error is not None:
        job.error = error


def claim_work(session: Session, node: str, platform: CloudPlatform | None = None) -> Job | None:
    """The node's job whose host steps are not finished; a queued one becomes running. Commits.

    With a platform that has switch hooks, a queued job starts only once the platform is usable and has
    taken the node out of scheduling (:func:`take_hold`); until then the caller gets None, and the job
    says why it waits.
    """
    job = session.scalars(
        select(Job)
        .where(
            Job.node == node,
            Job.state.in_([JobState.QUEUED.value, JobState.RUNNING.value]),
            Job.host_state.in_([HostState.PENDING.value, HostState.RUNNING.value]),
        )
        .order_by(Job.id)
        .with_for_update()
    ).first()
    if job is None:
        session.rollback()
        return None
    if job.state == JobState.QUEUED.value:
        hooks = switch_hooks(platform)
        if hooks is not None and not take_hold(session, hooks, job):
            return None
        job.state = JobState.RUNNING.value
        job.host_state = HostState.RUNNING.value
        job.started_at = job.updated_at = now()
        session.commit()
    return job


# --- the cloud platform around a job ------------------------------------------------------------------------
#
# ``Job.cloud`` (JSON) records what the platform did, so any server process can finish or undo it:
#   {"waiting_since": iso}             the platform was not usable when the agent asked for the job
#   {"taking": iso}                    before_switch is running (another claim must not start it twice)
#   {"hold": {...}, "released": bool,  before_switch's hold; released once after_switch ran,
#    "problems": [...]}                with what it could not undo


def take_hold(session: Session, hooks: SwitchHooks, job: Job) -> bool:
    """Wait for the platform, then run ``before_switch`` and store its hold. Commits. False: not now (the
    job waits, or it ended because the platform refused or stayed away too long)."""
    record = dict(job.cloud or {})
    if "taking" in record or "hold" in record:
        session.rollback()  # another request is taking the hold right now
        return False
    why = hooks.ready()
    if why is not None:
        _wait_for_cloud(session, hooks, job, record, why)
        return False
    job.cloud = {"taking": now().isoformat()}
    session.commit()  # marks the job before the (slow) platform calls, and lets go of its row
    policy_ = VmPolicy(job.request.get("vm_policy") or VmPolicy.GPU.value)
    try:
        hold = hooks.before_switch(job.node, job=f"job {job.id}", policy=policy_)
    except CloudError as exc:
        session.refresh(job, with_for_update=True)
        job.cloud = {}
        if JobState(job.state) is JobState.QUEUED:
            _finish(job, JobState.FAILED, f"the cloud platform did not let the switch start: {exc}")
            _ended(session, job)
        session.commit()
        return False
    session.refresh(job, with_for_update=True)
    job.cloud = {"hold": hold, "released": False, "problems": []}
    if JobState(job.state) is not JobState.QUEUED:  # cancelled while the hold was being taken
        release_hold(hooks, job, succeeded=False)
        session.commit()
        return False
    job.error = None  # the waiting message, if any
    return True


def _wait_for_cloud(session: Session, hooks: SwitchHooks, job: Job, record: dict[str, Any], why: str) -> None:
    stamp = now()
    since = record.get("waiting_since") or stamp.isoformat()
    waited = (stamp - datetime.fromisoformat(since)).total_seconds()
    if waited >= hooks.ready_timeout_s:
        job.cloud = {}
        _finish(
            job,
            JobState.FAILED,
            f"gave up after waiting {waited:.0f}s for the cloud platform; nothing was changed: {why}",
        )
        _ended(session, job)
    else:
        job.cloud = {"waiting_since": since}
        job.error = f"waiting for the cloud platform before starting (since {since}): {why}"
        job.updated_at = stamp
    session.commit()


def release_hold(hooks: SwitchHooks, job: Job, *, succeeded: bool) -> None:
    """``after_switch`` for the job's hold, once; what it could not undo is kept with the job and its
    error. A platform that fails here leaves the hold unreleased, for :func:`recover` to try again."""
    record = dict(job.cloud or {})
    if "hold" not in record or record.get("released"):
        return
    try:
        problems = hooks.after_switch(dict(record["hold"]), succeeded=succeeded)
    except CloudError as exc:
        log.error("job %s: could not release the cloud hold: %s", job.id, exc)
        job.cloud = {**record, "problems": [f"after_switch failed, will retry: {exc}"]}
        job.error = "; ".join(x for x in (job.error, f"the cloud hold was not released: {exc}") if x)
        return
    job.cloud = {**record, "released": True, "problems": problems}
    if problems:
        job.error = "; ".join(x for x in (job.error, *problems) if x)


def _end(platform: CloudPlatform, job: Job, state: JobState, error: str | None = None) -> None:
    """End the job, then give the node back to the cloud (restarting moved instances unless it
    succeeded)."""
    _finish(job, state, error)
    hooks = switch_hooks(platform)
    if hooks is not None:
        release_hold(hooks, job, succeeded=state is JobState.SUCCEEDED)


def _ended(session: Session, job: Job) -> None:
    """The event and the rollout's next move for a job that ended outside an API call that does them."""
    from gpumode.server import rollouts  # rollouts builds on this module

    session.add(ended_event(job))
    rollouts.after_job(session, job)


def cancel(session: Session, job: Job, by: str) -> None:
    """Cancel a queued job at once; ask the agent to roll a running one back (the caller commits)."""
    state = JobState(job.state)
    if not state.active:
        raise JobConflict(f"job {job.id} is already {state.value}")
    if state is JobState.QUEUED:
        for step in job.steps:
            step["state"] = StepState.SKIPPED.value
            step["note"] = "cancelled before it ran"
        job.steps = list(job.steps)
        _finish(job, JobState.CANCELLED, f"cancelled by {by} before it started")
        return
    if job.host_state != HostState.RUNNING.value:
        raise JobConflict(f"job {job.id}: the host steps are over; only its cloud steps are left")
    job.cancel_requested = True
    job.error = f"cancel requested by {by}"
    job.updated_at = now()


@dataclass(frozen=True, slots=True)
class StepReport:
    step: str
    state: StepState
    at: datetime | None = None
    error: str | None = None
    note: str | None = None


def apply_step_reports(
    job: Job, reports: Sequence[StepReport], platform: CloudPlatform | None = None
) -> None:
    """Fold the agent's step reports into the job (repeating one is harmless). Unknown steps are refused.

    A step whose params say ``checkpoint: true`` (the platform's own setup on the host, e.g. restarting
    nova-compute) reported done makes the server check the platform at once: if it is not usable, the answer
    asks the agent to roll the host back, while it still can.
    """
    by_id = {s["id"]: dict(s) for s in job.steps}
    for report in reports:
        step = by_id.get(report.step)
        if step is None:
            raise JobError("unknown_step", f"job {job.id} has no step {report.step!r}", sorted(by_id))
        if step["where"] != "host":
            raise JobError("cloud_step", f"step {report.step} is a cloud step: the server runs it")
        at = (report.at or now()).isoformat()
        if report.state is StepState.RUNNING:
            step["started_at"] = step["started_at"] or at
            step["finished_at"] = None
        else:
            step["started_at"] = step["started_at"] or at
            step["finished_at"] = at
        step["state"] = report.state.value
        step["error"] = report.error
        step["note"] = report.note
        by_id[report.step] = step
    job.steps = [by_id[s["id"]] for s in job.steps]
    job.updated_at = now()
    hooks = switch_hooks(platform)
    if hooks is not None and not job.cancel_requested:
        _checkpoint(hooks, job, reports)


def _checkpoint(hooks: SwitchHooks, job: Job, reports: Sequence[StepReport]) -> None:
    params = {s["id"]: s.get("params") or {} for s in job.plan["steps"]}
    for report in reports:
        if report.state is StepState.DONE and params.get(report.step, {}).get("checkpoint"):
            why = hooks.ready()
            if why is not None:
                job.cancel_requested = True
                job.error = f"the cloud platform failed mid-switch (after step {report.step}): {why}"
                return


def host_finished(
    session: Session, platform: CloudPlatform, job: Job, result: HostState, error: str | None
) -> None:
    """The agent's last word on the host steps; on success the cloud steps run now (the caller commits)."""
    if result in (HostState.PENDING, HostState.RUNNING):
        raise JobError("bad_result", f"a host result must be done, rolled_back or failed, not {result.value}")
    job.host_state = result.value
    job.updated_at = now()
    if result is HostState.DONE:
        run_cloud_steps(session, platform, job)
        return
    cancelled = job.cancel_requested and result is HostState.ROLLED_BACK
    why = (job.error + "; the host was rolled back") if cancelled and job.error else error
    _end(platform, job, JobState.ROLLED_BACK if result is HostState.ROLLED_BACK else JobState.FAILED, why)


# --- cloud steps (method step 7) ----------------------------------------------------------------------------


def run_cloud_steps(session: Session, platform: CloudPlatform, job: Job) -> None:
    """Run the job's cloud steps in order against the node's stored (freshly reported) snapshot, then end
    the job."""
    node = session.get(Node, job.node_id)
    if node is None:
        _end(platform, job, JobState.FAILED, f"node {job.node} was removed before its cloud steps ran")
        return
    snapshot = HostSnapshot.from_dict(node.snapshot)
    plan_steps = {s["id"]: s for s in job.plan["steps"]}
    steps = [dict(s) for s in job.steps]
    failure: str | None = None
    for step in steps:
        if step["where"] != "cloud" or step["state"] in (StepState.DONE.value, StepState.SKIPPED.value):
            continue
        step["started_at"] = now().isoformat()
        if failure is not None:
            step["state"], step["note"] = StepState.SKIPPED.value, "an earlier cloud step failed"
            step["finished_at"] = step["started_at"]
            continue
        params = plan_steps[step["id"]]["params"]
        try:
            step["note"] = _cloud_step(platform, snapshot, step["action"], params, job)
            step["state"] = StepState.DONE.value
        except CloudStepError as exc:
            step["state"], step["error"] = StepState.FAILED.value, str(exc)
            failure = f"cloud step {step['id']} failed: {exc}"
        step["finished_at"] = now().isoformat()
    job.steps = steps
    if failure is not None:
        _end(platform, job, JobState.FAILED, failure)
    else:
        _end(platform, job, JobState.SUCCEEDED)


class CloudStepError(RuntimeError):
    """A cloud step found the platform or the host not as the plan expects."""


def _cloud_step(
    platform: CloudPlatform, snapshot: HostSnapshot, action: str, params: dict[str, Any], job: Job
) -> str:
    if action == "cloud.register_cards":
        note = _register_cards(platform, snapshot, params["cards"])
        hooks = switch_hooks(platform)
        if hooks is None:
            return note
        try:
            setup = hooks.set_up_cards(
                snapshot, alias=job.request.get("passthrough_alias"), delivered=_delivered(job)
            )
        except CloudError as exc:
            raise CloudStepError(str(exc)) from exc
        return "; ".join(x for x in (note, setup) if x)
    if action == "cloud.deploy_env":
        return _deploy_env(platform, snapshot, params)
    raise CloudStepError(f"unknown cloud action {action!r}")


def _delivered(job: Job) -> bool:
    """Did the job's host steps include the platform's own setup (its ``checkpoint`` step), done?"""
    params = {s["id"]: s.get("params") or {} for s in job.plan["steps"]}
    return any(
        params.get(s["id"], {}).get("checkpoint") and s["state"] in (StepState.DONE.value, "skipped")
        for s in job.steps
    )


def _register_cards(platform: CloudPlatform, snapshot: HostSnapshot, cards: list[dict[str, Any]]) -> str:
    """Make sure the platform offers the cards of each switched GPU's new mode, and that the host shows it.

    The hardware sync already registered what the fresh snapshot offers; this registers anything still
    missing (a platform whose sync lagged) and refuses a GPU whose new mode the host does not show.
    """
    node = snapshot.hostname
    existing = {c.key for c in platform.list_cards(node=node) if c.status is not CardStatus.LOST}
    missing = [s for s in cards_for_snapshot(snapshot) if s.key not in existing]
    platform.register_cards(missing)
    offered = {(c.gpu, c.kind) for c in platform.list_cards(node=node) if c.status is not CardStatus.LOST}
    counts: dict[str, int] = {}
    for card in platform.list_cards(node=node, kind=Mode.VGPU):
        counts[card.gpu] = counts.get(card.gpu, 0) + 1
    for want in cards:
        gpu, mode = want["gpu"], Mode(want["mode"])
        found = snapshot.gpu(gpu)
        if found is None or found.mode is not mode:
            shown = "absent" if found is None else found.mode.value
            raise CloudStepError(f"GPU {gpu} is {shown} on the host, the plan switched it to {mode.value}")
        if (gpu, mode) not in offered:
            raise CloudStepError(f"no {mode.value} card for GPU {gpu} after registering")
        count = want.get("vgpu_count")
        if mode is Mode.VGPU and count is not None and counts.get(gpu, 0) != count:
            raise CloudStepError(f"GPU {gpu} offers {counts.get(gpu, 0)} vGPU card(s), the plan made {count}")
    return f"{len(cards)} GPU(s) offer {', '.join(sorted({c['mode'] for c in cards}))} cards" + (
        f"; {len(missing)} card(s) registered" if missing else ""
    )


def _deploy_env(platform: CloudPlatform, snapshot: HostSnapshot, params: dict[str, Any]) -> str:
    """What the compute service needs besides the cards: passthrough GPUs exposed under their alias."""
    modes = params.get("modes") or []
    if "passthrough" in modes:
        known = {a.name for a in platform.list_aliases()}
        added = []
        for address in params.get("gpus") or []:
            gpu = snapshot.gpu(address)
            alias = params.get("alias")
            if gpu is None or not alias or "," in alias or alias in known:
                continue
            platform.put_alias(PassthroughAlias(alias, 0x10DE, gpu.device, "registered by a switch job"))
            known.add(alias)
            added.append(alias)
        return f"passthrough alias {params.get('alias')}" + (" registered" if added else " present")
    if "vgpu" in modes:
        return f"vGPU devices of type {params.get('vgpu_type')} created on the host by the host steps"
    return "accel: container runtime hooks and persistence daemon set up by the host steps"


# --- recovery and metrics -----------------------------------------------------------------------------------


def recover(session: Session, platform: CloudPlatform) -> list[int]:
    """At server start: finish the cloud steps of jobs whose host part ended while no server was there."""
    ids = list(
        session.scalars(
            select(Job.id).where(Job.state == JobState.RUNNING.value, Job.host_state == HostState.DONE.value)
        )
    )
    for job_id in ids:
        job = get_job(session, job_id, lock=True)
        if job.state == JobState.RUNNING.value and job.host_state == HostState.DONE.value:
            run_cloud_steps(session, platform, job)
            session.add(ended_event(job, note="cloud steps finished after a server restart"))
        session.commit()
    _recover_holds(session, platform)
    return ids


RELEASE_RETRY_DAYS = 7  # how far back a restarted server looks for holds it could not release


def _recover_holds(session: Session, platform: CloudPlatform) -> None:
    """Holds a dead server left: release those of ended jobs; forget a hold being taken by a queued job (the
    next claim takes it again: ``before_switch`` recognises its own disable)."""
    hooks = switch_hooks(platform)
    if hooks is None:
        return
    recent = now() - timedelta(days=RELEASE_RETRY_DAYS)
    query = select(Job).where(
        Job.cloud.is_not(None),
        or_(Job.state.in_([s.value for s in JobState if s.active]), Job.finished_at > recent),
    )
    for job in session.scalars(query.order_by(Job.id)):
        record = job.cloud or {}
        if JobState(job.state).active:
            if job.state == JobState.QUEUED.value and "taking" in record:
                job.cloud = {}
        elif "hold" in record and not record.get("released"):
            release_hold(hooks, job, succeeded=job.state == JobState.SUCCEEDED.value)
    session.commit()


def ended_event(job: Job, note: str | None = None) -> Event:
    """The event that says how a job ended (``GET /events?kind=job.``)."""
    severity = sync.Severity.INFO if job.state == JobState.SUCCEEDED.value else sync.Severity.WARNING
    extra = "; ".join(x for x in (job.error, note) if x)
    return sync.make_event(
        job.node,
        f"job.{job.state}",
        severity,
        f"job:{job.id}",
        f"switch job {job.id} to {job.request.get('mode')}: {job.state}" + (f" ({extra})" if extra else ""),
        now(),
    )


class JobsCollector(Collector):
    """``gpumode_jobs{state}``, counted in the database at scrape time (true for every server process)."""

    def __init__(self, sessions: Any) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("gpumode_jobs", "Switch jobs by state", labels=["state"])
        with self.sessions() as session:
            counts = dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all())
        for state in JobState:
            family.add_metric([state.value], counts.get(state.value, 0))
        yield family
