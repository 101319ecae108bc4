"""Why the switch service refused something, as :class:`~gpumode.errors.GpumodeError` (code, message,
choices; the table of codes is :data:`gpumode.errors.CODES`). The API, the dashboard and the CLI each render
these; a request the planner refuses is the policy's :class:`~gpumode.modes.policy.RequestError`, the same
error the local CLI shows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpumode.errors import GpumodeError


class JobError(GpumodeError, ValueError):
    """A switch cannot be made a job (an unknown profile, a cloud platform refusing, ...)."""

    def __init__(self, code: str, message: str, choices: Sequence[str] = ()) -> None:
        super().__init__(message, code=code, choices=choices)

    def __str__(self) -> str:
        return self.message  # the choices are shown apart (the API's ``choices``)


class NotFound(GpumodeError, LookupError):
    """A node, job, host group or rollout the request names does not exist."""

    default_code = "not_found"


class ActiveJobExists(GpumodeError, RuntimeError):
    """The node already has a queued or running job."""

    default_code = "active_job"

    def __init__(self, node: str, job_id: int | None) -> None:
        what = f"job {job_id}" if job_id is not None else "another job"
        super().__init__(f"node {node} already has an active switch ({what}); wait for it or cancel it")
        self.job_id = job_id


class JobConflict(GpumodeError, RuntimeError):
    """The job is not in a state that allows this (e.g. cancelling a finished job)."""

    default_code = "job_conflict"


def refusal_detail(exc: GpumodeError) -> dict[str, Any]:
    """A refusal as the API's 422 body shows it (code, message, choices)."""
    return {"code": exc.code, "message": exc.message, "choices": list(exc.choices)}
