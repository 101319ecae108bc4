"""``gpumode_jobs{state}`` for ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from gpumode.server.models import Job
from gpumode.server.switch.states import JobState


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
