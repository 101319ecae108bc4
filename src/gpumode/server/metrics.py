"""Prometheus metrics: hosts by mode and cards by status (read from the database at scrape time, so every
server process reports the same truth) and sync outcomes and latency (counted in this process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpumode.cloud.embedded import CardRecord
from gpumode.server.models import Node

SYNC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _InventoryCollector(Collector):
    def __init__(self, sessions: Callable[[], Session]) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        hosts = GaugeMetricFamily(
            "gpumode_hosts", "Hosts by mode (mixed: GPUs in different modes)", labels=["mode"]
        )
        cards = GaugeMetricFamily("gpumode_cards", "Cards by kind and status", labels=["kind", "status"])
        with self.sessions() as session:
            for mode, count in session.execute(select(Node.mode, func.count()).group_by(Node.mode)):
                hosts.add_metric([mode], count)
            query = select(CardRecord.kind, CardRecord.status, func.count()).group_by(
                CardRecord.kind, CardRecord.status
            )
            for kind, status, count in session.execute(query):
                cards.add_metric([kind, status], count)
        yield hosts
        yield cards


class Metrics:
    """One registry per app, so several apps (tests, benchmarks) never collide."""

    def __init__(self, sessions: Callable[[], Session]) -> None:
        self.registry = CollectorRegistry()
        self.reports = Counter(
            "gpumode_reports", "Hardware reports by outcome", ["result"], registry=self.registry
        )
        self.sync_seconds = Histogram(
            "gpumode_sync_seconds",
            "Time to handle one hardware report",
            ["result"],
            buckets=SYNC_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_InventoryCollector(sessions))

    def observe_report(self, result: str, seconds: float) -> None:
        self.reports.labels(result).inc()
        self.sync_seconds.labels(result).observe(seconds)
