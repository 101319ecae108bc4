"""Fixtures: one real Placement per test session (emptied before each test), a fake Nova per test, an emulated
host whose nova-compute is REAL nova-compute (``real_stack``, tests marked ``nova``:
:class:`~tests.openstack.realnova.RealNovaCompute`) or, where a test needs nova-compute to misbehave on cue,
the stand-in :class:`~tests.openstack.reporter.NovaComputeReporter` (``stack``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from gpumode.cloud.embedded import metadata
from gpumode.cloud.openstack.channel import HostChannel
from gpumode.cloud.openstack.config import OpenStackConfig
from gpumode.cloud.openstack.factory import build_clients
from gpumode.cloud.openstack.platform import OpenStackPlatform
from gpumode.domain import Mode, SwitchRequest, VmPolicy
from gpumode.emulated.create import create_host
from gpumode.host.discover import discover
from gpumode.host.root import CommandResult, Host
from gpumode.modes import engine

from .realnova import RealNovaCompute, nova_python
from .reporter import NovaComputeReporter
from .services import FakeNova, Faults, PlacementAdmin, Served, start_placement

pytest.importorskip(
    "placement", reason="openstack-placement is not installed (pip install gpumode[openstack])"
)

RESTART = ["systemctl", "restart", "nova-compute"]


@pytest.fixture(scope="session")
def placement_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Faults]]:
    served, faults = start_placement(tmp_path_factory.mktemp("placement"))
    yield served, faults
    served.stop()


@pytest.fixture
def placement(placement_service: tuple[Served, Faults]) -> Iterator[PlacementAdmin]:
    served, faults = placement_service
    faults.reset()
    admin = PlacementAdmin(served.url)
    admin.wipe()
    yield admin
    faults.reset()


@pytest.fixture
def faults(placement_service: tuple[Served, Faults]) -> Faults:
    return placement_service[1]


@pytest.fixture
def nova() -> Iterator[tuple[FakeNova, Served]]:
    fake = FakeNova()
    served = Served(fake)
    yield fake, served
    served.stop()


@pytest.fixture(scope="session")
def t4_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tpl") / "host"
    create_host("t4-mdev", root)
    return root


@pytest.fixture
def host(tmp_path: Path, t4_template: Path) -> Host:
    import shutil

    shutil.copytree(t4_template, tmp_path / "host", symlinks=True)
    return Host(tmp_path / "host")


class NovaCompute(Protocol):
    def restart(self) -> None: ...


@pytest.fixture(scope="session")
def nova_venv_python() -> str:
    """The nova venv (installed on first use, see ``scripts/install-openstack-test-deps.sh``)."""
    return nova_python()


class ReporterChannel(HostChannel):
    """The agent's side: writes the drop-in on the host; the restart command makes 'nova-compute' report."""

    def __init__(self, host: Host, reporter: NovaCompute) -> None:
        self.reporter = reporter
        super().__init__({discover(host).hostname: host})
        self.broken_restart = False

    def run(self, node: str, argv: Sequence[str]) -> CommandResult:
        if list(argv) == RESTART:
            if self.broken_restart:
                return CommandResult(tuple(argv), 1, "", "Job for nova-compute.service failed.")
            self.reporter.restart()
            return CommandResult(tuple(argv), 0, "", "")
        return super().run(node, argv)


class Clock:
    """A fake clock: sleeping advances it, so waits time out instantly."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def __call__(self) -> float:
        return self.now


class Stack:
    """Everything a test needs around one emulated host."""

    def __init__(
        self,
        host: Host,
        placement: PlacementAdmin,
        nova: FakeNova,
        nova_url: str,
        *,
        nova_python: str | None = None,
        **config: Any,
    ):
        self.host = host
        self.placement = placement
        self.nova = nova
        self.name = discover(host).hostname
        self.config = OpenStackConfig(
            auth_type="noauth",
            placement_endpoint=placement.http.base_url.__str__().rstrip("/"),
            compute_endpoint=nova_url,
            pci_in_placement=True,
            inventory_timeout_s=5,
            poll_interval_s=0.5,
            vm_timeout_s=5,
            **config,
        )
        self.reporter = NovaComputeReporter(placement, host, self.config.nova_dropin)
        self.compute: NovaCompute = self.reporter
        if nova_python is not None:
            url = self.config.placement_endpoint or ""
            self.compute = self.real = RealNovaCompute(nova_python, url, host)
        self.channel = ReporterChannel(host, self.compute)
        self.clock = Clock()
        engine_ = create_engine("sqlite://")
        metadata.create_all(engine_)
        self.session = Session(engine_)
        self.platform = OpenStackPlatform(
            self.session,
            self.config,
            build_clients(self.config, self.channel),
            sleep=self.clock.sleep,
            clock=self.clock,
        )

    def switch(self, mode: Mode, **options: Any) -> None:
        """The host steps of a switch, run by the local engine on the emulated host."""
        result = engine.apply(self.host, SwitchRequest(mode=mode, vm_policy=VmPolicy.ALL, **options))
        assert result.ok, result

    def provider(self, name: str) -> dict[str, Any]:
        return self.placement.providers()[name]

    def gpu_providers(self) -> dict[str, dict[str, Any]]:
        return {n: p for n, p in self.placement.providers().items() if n.startswith(self.name + "_")}


@pytest.fixture
def stack(host: Host, placement: PlacementAdmin, nova: tuple[FakeNova, Served]) -> Stack:
    fake, served = nova
    fake.add_service(discover(host).hostname)
    return Stack(host, placement, fake, served.url)


@pytest.fixture
def real_stack(
    host: Host, placement: PlacementAdmin, nova: tuple[FakeNova, Served], nova_venv_python: str
) -> Stack:
    """:func:`stack` with REAL nova-compute behind the restart command."""
    fake, served = nova
    fake.add_service(discover(host).hostname)
    return Stack(host, placement, fake, served.url, nova_python=nova_venv_python)
