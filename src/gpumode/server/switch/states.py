"""The states a switch job, its host part and each of its steps can be in, as stored and as the API shows."""

from __future__ import annotations

from enum import StrEnum

from gpumode.domain import StepState as StepState  # a job's steps: the one vocabulary of journal and API


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


ACTIVE_STATES = (JobState.QUEUED.value, JobState.RUNNING.value)


class HostState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
