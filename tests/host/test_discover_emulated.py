"""Discovery on the shipped emulated hosts (skipped when the emulated host package is absent), checked
against lspci reading the same tree (the emulated kernel and discovery have different authors)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_discover_tree import lspci, needs_lspci, parse_lspci

from gpumode.domain import DriverState, Mode
from gpumode.host.discover import discover

create = pytest.importorskip("gpumode.emulated.create")
fixtures = pytest.importorskip("gpumode.emulated.fixtures")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("emulated")
    built = {}
    for name in sorted(fixtures.FIXTURES):
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
@pytest.mark.parametrize("name", sorted(fixtures.FIXTURES))
def test_lspci_agrees_with_discover_json(hosts: dict[str, Path], name: str) -> None:
    """The issue's check, on every fixture: `lspci -D -nn -k` and `gpumode discover --json` (the real command)
    agree on every function's address, ids, class, revision and driver."""
    root = hosts[name]
    expected = parse_lspci(
        lspci("-D", "-nn", "-k", "-A", "linux-sysfs", "-O", f"sysfs.path={root}/sys/bus/pci")
    )
    out = subprocess.run(
        [sys.executable, "-m", "gpumode", "discover", "--json", "--root", str(root)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found = {fn["address"]: fn for fn in json.loads(out)["functions"]}
    assert len(found) >= 10 and set(found) == set(expected)
    for address, entry in expected.items():
        fn = found[address]
        assert (fn["vendor"], fn["device"], fn["class_code"] >> 8, fn["revision"], fn["driver"]) == (
            entry.vendor,
            entry.device,
            entry.class_id,
            entry.revision,
            entry.driver,
        ), address


def test_hgx_h100(hosts: dict[str, Path]) -> None:
    snap = discover(hosts["hgx-h100"])
    assert snap.problems == []
    assert len(snap.functions) >= 150 and len(snap.gpus) == 8 and len(snap.nvswitches) == 4
    assert {g.mode for g in snap.gpus} == {Mode.ACCEL} and snap.driver_state is DriverState.DATACENTER
    assert snap.nvidia.services["nvidia-fabricmanager.service"]


@pytest.mark.parametrize("name", ["a16-vdi", "l40s-sriov", "hgx-h100"])
def test_enabled_vfs_are_where_offset_and_stride_put_them(hosts: dict[str, Path], name: str) -> None:
    """Every SR-IOV PF's offset and stride are read, and the VFs the kernel made (its virtfn links) are the
    addresses worked out from them: what the planner relies on for VFs that do not exist yet."""
    snap = discover(hosts[name])
    assert snap.problems == []
    pfs = [fn for fn in snap.functions if fn.sriov is not None]
    assert pfs, f"{name} has no SR-IOV PF"
    for fn in pfs:
        assert fn.sriov is not None and fn.sriov.offset is not None and fn.sriov.stride is not None
        assert fn.vf_addresses(fn.sriov.num_vfs) == fn.sriov.vfs, fn.address
    assert any(fn.sriov and fn.sriov.vfs for fn in pfs) or name == "hgx-h100"  # hgx: accel, VFs off
