"""Discovery on the shipped emulated hosts (skipped when the emulated host package is absent), checked
against lspci reading the same tree (the emulated kernel and discovery have different authors)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_discover_tree import lspci, needs_lspci, parse_lspci

from gpumode.domain import DriverState, Mode
from gpumode.host.discover import discover

create = pytest.importorskip("gpumode.host.emulated.create")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("emulated")
    built = {}
    for name in ("rtx-workstation", "t4-mdev", "l40s-sriov"):
        create.create_host(name, root / name)
        built[name] = root / name
    return built


def test_rtx_workstation_passthrough_group(hosts: dict[str, Path]) -> None:
    snap = discover(hosts["rtx-workstation"])
    assert snap.problems == []
    (gpu,) = snap.gpus
    assert gpu.mode is Mode.PASSTHROUGH and snap.driver_state is DriverState.VFIO
    vga = snap.function(gpu.address)
    assert vga is not None and vga.consumers  # the HDA function, by its consumer:pci: link
    assert set(vga.consumers) <= set(gpu.companions)
    assert all(snap.function(c) is not None for c in gpu.companions)


def test_l40s_vendor_vgpu(hosts: dict[str, Path]) -> None:
    snap = discover(hosts["l40s-sriov"])
    assert snap.problems == []
    assert snap.driver_state is DriverState.VGPU_HOST
    for gpu in snap.gpus:
        assert gpu.mode is Mode.VGPU
        for vf in gpu.vfs:
            fn = snap.function(vf)
            assert fn is not None and fn.physfn == gpu.address and fn.vendor_vgpu is not None
            assert (vf in gpu.vgpus) == (fn.vendor_vgpu.current != 0)
    assert any(gpu.vgpus for gpu in snap.gpus)


def test_t4_host_without_driver(hosts: dict[str, Path]) -> None:
    snap = discover(hosts["t4-mdev"])
    assert snap.problems == []
    assert all(g.mode is Mode.NONE for g in snap.gpus) and snap.driver_state is DriverState.NONE


@needs_lspci
@pytest.mark.parametrize("name", ["rtx-workstation", "t4-mdev", "l40s-sriov"])
def test_lspci_agrees_on_emulated_hosts(hosts: dict[str, Path], name: str) -> None:
    root = hosts[name]
    expected = parse_lspci(
        lspci("-D", "-nn", "-k", "-A", "linux-sysfs", "-O", f"sysfs.path={root}/sys/bus/pci")
    )
    found = {fn.address: fn for fn in discover(root).functions}
    assert set(found) == set(expected)
    for address, entry in expected.items():
        fn = found[address]
        assert (fn.vendor, fn.device, fn.class_code >> 8, fn.revision, fn.driver) == (
            entry.vendor,
            entry.device,
            entry.class_id,
            entry.revision,
            entry.driver,
        ), address


@pytest.mark.slow
def test_hgx_h100(tmp_path: Path) -> None:
    create.create_host("hgx-h100", tmp_path / "hgx")
    snap = discover(tmp_path / "hgx")
    assert snap.problems == []
    assert len(snap.functions) >= 150 and len(snap.gpus) == 8 and len(snap.nvswitches) == 4
    assert {g.mode for g in snap.gpus} == {Mode.ACCEL} and snap.driver_state is DriverState.DATACENTER
    assert snap.nvidia.services["nvidia-fabricmanager.service"]
