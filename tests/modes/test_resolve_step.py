"""`vgpu.resolve`: a plan made from the catalog checks the host's own vGPU types right after the vGPU manager
comes up, and fails before it creates anything when they differ."""

from __future__ import annotations

from pathlib import Path

import yaml
from engine_support import make_host
from plan_builders import T4, HostBuilder, plan, request

from gpumode.domain import Mode, SwitchRequest
from gpumode.host.discover import discover
from gpumode.modes import engine
from gpumode.modes.journal import JournalStore

G1, G2 = "0000:17:00.0", "0000:3a:00.0"


def test_a_plan_from_the_catalog_resolves_before_it_creates() -> None:
    snap = HostBuilder().gpu(G1, T4).gpu(G2, T4).build()
    p = plan(snap, request(Mode.VGPU, vgpu_type="T4-4Q", vgpu_count=2))
    actions = [s.action for s in p.steps]
    for gpu in (G1, G2):
        resolve = next(i for i, s in enumerate(p.steps) if s.action == "vgpu.resolve" and s.target == gpu)
        creates = [i for i, s in enumerate(p.steps) if s.action == "vgpu.create" and s.target == gpu]
        assert creates and resolve < min(creates)
        assert p.steps[resolve].params == {"name": "GRID T4-4Q", "type": 232, "interface": "mdev"}
    assert actions.index("driver.install") < actions.index("vgpu.resolve")


def test_a_plan_from_the_host_does_not_resolve() -> None:
    snap = (
        HostBuilder()
        .gpu(G1, T4, mode=Mode.VGPU, pf_mdev_types=((232, "GRID T4-4Q", 4),))
        .vgpu_manager()
        .build()
    )
    p = plan(snap, request(Mode.VGPU, vgpu_type="T4-4Q", vgpu_count=1))
    assert "vgpu.resolve" not in [s.action for s in p.steps] and "vgpu.create" in [s.action for s in p.steps]


def test_the_emulated_host_passes_the_check_and_gets_its_vgpus(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    result = engine.apply(host, SwitchRequest(Mode.VGPU, vgpu_type="GRID T4-4Q", vgpu_count=1))
    assert result.ok
    assert all(g.mdevs for g in discover(host).gpus)


def test_a_wrong_catalog_id_fails_before_any_vgpu_and_rolls_back(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    data = yaml.safe_load((Path(__file__).parents[2] / "src/gpumode/data/catalog.yaml").read_text())
    for t in data["gpu_models"]["10de:1eb8"]["vgpu"]["types"]:
        if t["name"] == "GRID T4-4Q":
            t["id"] = 999  # what an outdated catalog might say
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(data))
    config = engine.EngineConfig(catalog=path)
    result = engine.apply(host, SwitchRequest(Mode.VGPU, vgpu_type="GRID T4-4Q", vgpu_count=1), config=config)
    assert not result.ok and result.run is not None
    assert "vgpu.resolve" in (result.run.error or "") and "999" in (result.run.error or "")
    assert "host's id for GRID T4-4Q is 232" in (result.run.error or "")
    (journal,) = JournalStore(host).history(limit=1)
    ran = {e.action for e in journal.steps if e.touched}
    assert "vgpu.create" not in ran
    assert not any(g.mdevs for g in discover(host).gpus)
