"""Why the switch service refused something; the API, the dashboard and the CLI each render these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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
