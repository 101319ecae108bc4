"""The cloud steps of a job (method step 7), run by the server once the host steps are done, each action
from :data:`CLOUD_STEPS` as the host's steps run from theirs; and, after a host was undone, putting the
cloud's picture of it back."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from gpumode.cloud.base import (
    CardStatus,
    CloudError,
    CloudPlatform,
    CloudUnavailable,
    PassthroughAlias,
    cards_for_snapshot,
)
from gpumode.domain import HostSnapshot, Mode
from gpumode.server.models import Job, Node
from gpumode.server.switch.hold import end
from gpumode.server.switch.lifecycle import undo_host
from gpumode.server.switch.planning import switch_hooks
from gpumode.server.switch.states import JobState, StepState
from gpumode.server.switch.store import now


def run_cloud_steps(session: Session, platform: CloudPlatform, job: Job) -> None:
    """One try at the job's cloud steps, in order, against the node's stored (freshly reported) snapshot.

    All done: the job succeeds. The platform away for now (:class:`CloudUnavailable`: unreachable, 5xx,
    conflicts, inventory not shown yet): the step says so and what is left of the platform's
    ``retry_timeout_s``, and the job waits for the agent's next ask (:func:`retry_after`). The platform
    failing for good, or that time running out: the agent is asked to undo the host's run
    (:func:`undo_host`). A host that does not show the planned modes fails the job as it is.
    """
    node = session.get(Node, job.node_id)
    if node is None:
        end(platform, job, JobState.FAILED, f"node {job.node} was removed before its cloud steps ran")
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
            step["note"] = _run_step(platform, snapshot, step["action"], params, job)
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
        end(platform, job, JobState.SUCCEEDED)
    elif failure.undo_host:
        undo_host(job, f"cloud step {failed_id} failed after the host steps: {failure}")
    else:
        end(platform, job, JobState.FAILED, f"cloud step {failed_id} failed: {failure}")


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


def restore_cloud(session: Session, platform: CloudPlatform, job: Job) -> None:
    """After the host's run was undone: make the cloud show the host as it is again (the platform's card
    setup for the restored modes, e.g. Placement's traits and aggregates), then end the job ``rolled_back``.
    Waits for the platform like the cloud steps do; giving up still ends the job, saying what is left."""
    reason = str((job.cloud or {})["undo"]["reason"])
    hooks = switch_hooks(platform)
    node = session.get(Node, job.node_id)
    if hooks is None or node is None:
        end(platform, job, JobState.ROLLED_BACK, f"{reason}; the host was rolled back")
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
    end(platform, job, JobState.ROLLED_BACK, f"{reason}; the host was rolled back{tail}")


class CloudStepError(RuntimeError):
    """A cloud step found the platform or the host not as the plan expects. ``undo_host``: the platform
    failed (not the host), so the host's run is undone rather than left switched."""

    def __init__(self, message: str, *, undo_host: bool = False) -> None:
        super().__init__(message)
        self.undo_host = undo_host


class CloudStepWait(RuntimeError):
    """The platform cannot do the step now but may later (:class:`CloudUnavailable`)."""


def _delivered(job: Job) -> bool:
    """Did the job's host steps include the platform's own setup (its ``checkpoint`` step), done?"""
    params = {s["id"]: s.get("params") or {} for s in job.plan["steps"]}
    return any(
        params.get(s["id"], {}).get("checkpoint") and s["state"] in (StepState.DONE.value, "skipped")
        for s in job.steps
    )


def _register_cards(platform: CloudPlatform, snapshot: HostSnapshot, params: dict[str, Any], job: Job) -> str:
    """``cloud.register_cards``: the cards offered (:func:`_offer_cards`), then the platform's own card set-up
    (e.g. Placement's traits and aggregates) when it has switch hooks."""
    note = _offer_cards(platform, snapshot, params["cards"])
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


def _offer_cards(platform: CloudPlatform, snapshot: HostSnapshot, cards: list[dict[str, Any]]) -> str:
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
    switched = {c["gpu"] for c in cards}
    # counted as they are now on the platform: what the host really made, not what the plan asked for
    kinds = [
        c.kind.value
        for c in platform.list_cards(node=node)
        if c.gpu in switched and c.status is not CardStatus.LOST
    ]
    per_kind = ", ".join(f"{kinds.count(kind)} {kind}" for kind in sorted(set(kinds)))
    return f"{len(switched)} GPU(s) offer {per_kind or 'no'} card(s)" + (
        f"; {len(missing)} card(s) registered" if missing else ""
    )


def _deploy_env(platform: CloudPlatform, snapshot: HostSnapshot, params: dict[str, Any], job: Job) -> str:
    """``cloud.deploy_env``: what the compute service needs besides the cards (passthrough GPUs exposed
    under their alias)."""
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


CloudStep = Callable[[CloudPlatform, HostSnapshot, dict[str, Any], Job], str]

# Each cloud action a plan may hold (``modes/plan.py``), as ``modes/steps.py`` holds the host's.
CLOUD_STEPS: dict[str, CloudStep] = {
    "cloud.register_cards": _register_cards,
    "cloud.deploy_env": _deploy_env,
}


def _run_step(
    platform: CloudPlatform, snapshot: HostSnapshot, action: str, params: dict[str, Any], job: Job
) -> str:
    run = CLOUD_STEPS.get(action)
    if run is None:
        raise CloudStepError(f"unknown cloud action {action!r} (known: {', '.join(sorted(CLOUD_STEPS))})")
    return run(platform, snapshot, params, job)
