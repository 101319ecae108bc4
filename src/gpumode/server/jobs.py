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
    CloudUnavailable,
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
from gpumode.server.schemas import SwitchIn, Whitelist

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


def refusal_detail(exc: JobError | NotFound) -> dict[str, Any]:
    """A refusal as the API's 422 body shows it (code, message, choices), an unknown name included."""
    if isinstance(exc, JobError):
        return exc.detail()
    return {"code": "not_found", "message": str(exc), "choices": []}


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

    @classmethod
    def from_body(cls, body: SwitchIn) -> SwitchOptions:
        """The options of an API or dashboard request body: both read the same :class:`SwitchIn`."""
        return cls(
            mode=body.mode,
            gpus=tuple(body.gpus),
            vgpu_type=body.vgpu_type,
            vgpu_count=body.vgpu_count,
            profile=body.profile,
            passthrough_alias=body.passthrough_alias,
            vm_policy=body.vm_policy,
        )


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


def catalog() -> Catalog:
    """The built-in catalog (GPU models, vGPU types, driver flavours); ``load_catalog`` caches its parse."""
    return load_catalog(None)


def plan_for_node(
    session: Session,
    node: Node,
    request: SwitchRequest,
    whitelist: Whitelist,
    platform: CloudPlatform,
) -> Plan:
    """Plan ``request`` on the node as it last reported itself; :class:`JobError` when it may not run.

    The platform is required, not optional: the host steps it asks for (:meth:`SwitchHooks.host_steps`,
    e.g. delivering nova-compute's configuration) are part of the plan, so a dry run shows exactly what a
    job runs, and no caller (a rollout, say) can plan a job that lacks them.
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


def claim_work(session: Session, node: str, platform: CloudPlatform) -> Job | None:
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
        if hooks is not None and not take_hold(session, platform, hooks, job):
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
# and, once the host steps are done (:func:`run_cloud_steps`), the tries at the cloud steps:
#   "cloud_since": iso, "attempts": n  when the first try ran, how many ran
#   "retry_after_s": s                 the platform is away: the agent asks again after this long
#   "undo": {"reason", "at"}           the cloud steps failed for good: the agent undoes the host's run
#   "restore_since", "restore_attempts" after that undo: putting the cloud's picture of the host back


def take_hold(session: Session, platform: CloudPlatform, hooks: SwitchHooks, job: Job) -> bool:
    """Wait for the platform, then run ``before_switch`` and store its hold. Commits. False: not now (the
    job waits, or it ended because the platform refused or stayed away too long). ``hooks`` is
    ``platform``'s :func:`switch_hooks`; the platform itself plans the rollout's next job if this one ends."""
    record = dict(job.cloud or {})
    if "taking" in record or "hold" in record:
        session.rollback()  # another request is taking the hold right now
        return False
    why = hooks.ready()
    if why is not None:
        _wait_for_cloud(session, platform, hooks, job, record, why)
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
            ended(session, job, platform)
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


def _wait_for_cloud(
    session: Session, platform: CloudPlatform, hooks: SwitchHooks, job: Job, record: dict[str, Any], why: str
) -> None:
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
        ended(session, job, platform)
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


def ended(session: Session, job: Job, platform: CloudPlatform, note: str | None = None) -> None:
    """What follows a job's end, wherever it ended (an API call, the dashboard, the platform refusing): its
    event, and its rollout's next move (planned with ``platform``, so the next job has the platform's host
    steps too). The caller commits."""
    from gpumode.server import rollouts  # rollouts builds on this module

    session.add(ended_event(job, note))
    rollouts.after_job(session, job, platform)


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
    if job.host_state == HostState.DONE.value:  # its cloud steps are waiting for the platform
        _undo_host(job, f"cancelled by {by} while the cloud steps waited")
        return
    if job.host_state != HostState.RUNNING.value:
        raise JobConflict(f"job {job.id}: the host was put back; the cloud's picture of it is being restored")
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
                # nova-compute may already have reported the new inventory: once the host is back, the
                # cloud's picture of it is put back too (:func:`restore_cloud`)
                reason = f"the cloud platform failed mid-switch (after step {report.step}): {why}"
                job.cloud = {**(job.cloud or {}), "undo": {"reason": reason, "at": now().isoformat()}}
                job.cancel_requested = True
                job.error = reason
                return


def host_finished(
    session: Session, platform: CloudPlatform, job: Job, result: HostState, error: str | None
) -> None:
    """The agent's last word on the host steps; on success the cloud steps run now (the caller commits)."""
    if result in (HostState.PENDING, HostState.RUNNING):
        raise JobError("bad_result", f"a host result must be done, rolled_back or failed, not {result.value}")
    job.host_state = result.value
    job.updated_at = now()
    undo = (job.cloud or {}).get("undo")
    if result is HostState.DONE and undo is not None:
        # the platform failed at a checkpoint, but the agent ended its run before it heard: undo the run
        _undo_host(job, str(undo["reason"]))
        return
    if result is HostState.DONE:
        run_cloud_steps(session, platform, job)
        return
    if undo is not None and result is HostState.ROLLED_BACK:
        restore_cloud(session, platform, job)
        return
    if undo is not None:
        _end(platform, job, JobState.FAILED, f"{undo['reason']}; putting the host back failed: {error}")
        return
    cancelled = job.cancel_requested and result is HostState.ROLLED_BACK
    why = (job.error + "; the host was rolled back") if cancelled and job.error else error
    _end(platform, job, JobState.ROLLED_BACK if result is HostState.ROLLED_BACK else JobState.FAILED, why)


# --- cloud steps (method step 7) ----------------------------------------------------------------------------


def run_cloud_steps(session: Session, platform: CloudPlatform, job: Job) -> None:
    """One try at the job's cloud steps, in order, against the node's stored (freshly reported) snapshot.

    All done: the job succeeds. The platform away for now (:class:`CloudUnavailable`: unreachable, 5xx,
    conflicts, inventory not shown yet): the step says so and what is left of the platform's
    ``retry_timeout_s``, and the job waits for the agent's next ask (:func:`retry_after`). The platform
    failing for good, or that time running out: the agent is asked to undo the host's run
    (:func:`_undo_host`). A host that does not show the planned modes fails the job as it is.
    """
    node = session.get(Node, job.node_id)
    if node is None:
        _end(platform, job, JobState.FAILED, f"node {job.node} was removed before its cloud steps ran")
        return
    snapshot = HostSnapshot.from_dict(node.snapshot)
    plan_steps = {s["id"]: s for s in job.plan["steps"]}
    steps = [dict(s) for s in job.steps]
    record, attempt, left = _next_try(platform, job, "cloud_since", "attempts")
    failure: CloudStepError | None = None
    failed_id = ""
    for step in steps:
        if step["where"] != "cloud" or step["state"] in (StepState.DONE.value, StepState.SKIPPED.value):
            continue
        step["started_at"] = step["started_at"] or now().isoformat()
        if failure is not None:
            step["state"], step["note"] = StepState.SKIPPED.value, "an earlier cloud step failed"
            step["finished_at"] = now().isoformat()
            continue
        params = plan_steps[step["id"]]["params"]
        try:
            step["note"] = _cloud_step(platform, snapshot, step["action"], params, job)
            step["state"], step["error"] = StepState.DONE.value, None
        except CloudStepWait as exc:
            if left > 0:
                step["state"], step["error"] = StepState.RUNNING.value, None
                step["note"] = f"{exc}; attempt {attempt}, retrying for {_duration(left)} more"
                job.steps = steps
                job.cloud = {**record, "retry_after_s": _backoff(platform, attempt, left)}
                job.error = f"{WAITING} (step {step['id']}): {step['note']}"
                job.updated_at = now()
                return
            failure = CloudStepError(f"gave up after {attempt} attempt(s): {exc}", undo_host=True)
        except CloudStepError as exc:
            failure = exc
        if failure is not None:
            step["state"], step["error"] = StepState.FAILED.value, str(failure)
            failed_id = step["id"]
        step["finished_at"] = now().isoformat()
    job.steps = steps
    job.cloud = {k: v for k, v in record.items() if k != "retry_after_s"}
    if job.error and job.error.startswith(WAITING):
        job.error = None  # the platform came back
    if failure is None:
        _end(platform, job, JobState.SUCCEEDED)
    elif failure.undo_host:
        _undo_host(job, f"cloud step {failed_id} failed after the host steps: {failure}")
    else:
        _end(platform, job, JobState.FAILED, f"cloud step {failed_id} failed: {failure}")


WAITING = "waiting for the cloud platform after the host steps"


def _next_try(
    platform: CloudPlatform, job: Job, since_key: str, count_key: str
) -> tuple[dict[str, Any], int, float]:
    """Count one more try; returns the job's cloud record, the try's number and the seconds left of the
    platform's ``retry_timeout_s`` since the first try."""
    record = dict(job.cloud or {})
    stamp = now()
    since = record.setdefault(since_key, stamp.isoformat())
    attempt = int(record.get(count_key, 0)) + 1
    record[count_key] = attempt
    hooks = switch_hooks(platform)
    budget = hooks.retry_timeout_s if hooks is not None else 0.0
    left = budget - (stamp - datetime.fromisoformat(since)).total_seconds()
    return record, attempt, left


def _backoff(platform: CloudPlatform, attempt: int, left: float) -> float:
    """Exponential from the platform's poll interval, at most ``MAX_RETRY_AFTER_S`` and never past the
    deadline (so the last try comes right at it)."""
    hooks = switch_hooks(platform)
    base = float(hooks.retry_interval_s) if hooks is not None else 1.0
    return round(max(0.05, min(base * 2.0 ** (attempt - 1), MAX_RETRY_AFTER_S, left)), 3)


MAX_RETRY_AFTER_S = 15.0


def _duration(seconds: float) -> str:
    """``45s``, ``2m``, ``2m30s``: how long a wait has left, for people."""
    whole = max(0, round(seconds))
    minutes, secs = divmod(whole, 60)
    if not minutes:
        return f"{secs}s"
    return f"{minutes}m{secs:02d}s" if secs else f"{minutes}m"


def retry_after(job: Job) -> float | None:
    """When the agent should ask again: while the job waits for the cloud platform (host steps over), else
    None."""
    waiting = job.host_state in (HostState.DONE.value, HostState.ROLLED_BACK.value)
    if not JobState(job.state).active or not waiting:
        return None
    value = (job.cloud or {}).get("retry_after_s")
    return float(value) if value is not None else None


def continue_cloud(session: Session, platform: CloudPlatform, job: Job) -> None:
    """The agent asks again about a job whose host part is over: one more try at what the server still does
    (the cloud steps, or putting the cloud's picture back after the host was undone)."""
    if job.host_state == HostState.DONE.value:
        run_cloud_steps(session, platform, job)
    elif job.host_state == HostState.ROLLED_BACK.value and "undo" in (job.cloud or {}):
        restore_cloud(session, platform, job)


def _undo_host(job: Job, reason: str) -> None:
    """Ask the agent to undo the host's finished run: the job runs again on the host (``cancel_requested``),
    and ends ``rolled_back`` once the agent reports the run undone and the cloud is put back. Nothing half
    done stays in the cloud: a failed try of the cloud steps undoes its own writes."""
    record = {k: v for k, v in (job.cloud or {}).items() if k != "retry_after_s"}
    job.cloud = {**record, "undo": {"reason": reason, "at": now().isoformat()}}
    job.host_state = HostState.RUNNING.value
    job.cancel_requested = True
    job.error = f"{reason}; rolling the host back"
    job.updated_at = now()


def restore_cloud(session: Session, platform: CloudPlatform, job: Job) -> None:
    """After the host's run was undone: make the cloud show the host as it is again (the platform's card
    setup for the restored modes, e.g. Placement's traits and aggregates), then end the job ``rolled_back``.
    Waits for the platform like the cloud steps do; giving up still ends the job, saying what is left."""
    reason = str((job.cloud or {})["undo"]["reason"])
    hooks = switch_hooks(platform)
    node = session.get(Node, job.node_id)
    if hooks is None or node is None:
        _end(platform, job, JobState.ROLLED_BACK, f"{reason}; the host was rolled back")
        return
    record, attempt, left = _next_try(platform, job, "restore_since", "restore_attempts")
    try:
        hooks.set_up_cards(HostSnapshot.from_dict(node.snapshot), delivered=True, wait=False)
    except CloudUnavailable as exc:
        if left > 0:
            job.cloud = {**record, "retry_after_s": _backoff(platform, attempt, left)}
            job.error = (
                f"{reason}; the host was rolled back; putting the cloud's picture of it back: {exc}; "
                f"attempt {attempt}, retrying for {_duration(left)} more"
            )
            job.updated_at = now()
            return
        problem = f"the cloud still shows the switch after {attempt} attempt(s): {exc}"
    except CloudError as exc:
        problem = f"putting the cloud's picture of it back failed: {exc}"
    else:
        problem = ""
    job.cloud = {k: v for k, v in record.items() if k != "retry_after_s"}
    tail = f"; {problem} (the next hardware sync puts it right)" if problem else ""
    _end(platform, job, JobState.ROLLED_BACK, f"{reason}; the host was rolled back{tail}")


class CloudStepError(RuntimeError):
    """A cloud step found the platform or the host not as the plan expects. ``undo_host``: the platform
    failed (not the host), so the host's run is undone rather than left switched."""

    def __init__(self, message: str, *, undo_host: bool = False) -> None:
        super().__init__(message)
        self.undo_host = undo_host


class CloudStepWait(RuntimeError):
    """The platform cannot do the step now but may later (:class:`CloudUnavailable`)."""


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
                snapshot, alias=job.request.get("passthrough_alias"), delivered=_delivered(job), wait=False
            )
        except CloudUnavailable as exc:
            raise CloudStepWait(str(exc)) from exc
        except CloudError as exc:
            raise CloudStepError(str(exc), undo_host=True) from exc
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
    """At server start: try the cloud steps of jobs whose host part ended while no server was there (and
    the cloud's picture of hosts put back meanwhile); a try that has to wait leaves the rest to the agent's
    next ask."""
    over = [HostState.DONE.value, HostState.ROLLED_BACK.value]
    ids = list(
        session.scalars(select(Job.id).where(Job.state == JobState.RUNNING.value, Job.host_state.in_(over)))
    )
    for job_id in ids:
        job = get_job(session, job_id, lock=True)
        if job.state == JobState.RUNNING.value and job.host_state in over:
            continue_cloud(session, platform, job)
            if not JobState(job.state).active:
                ended(session, job, platform, note="cloud steps finished after a server restart")
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
