"""`gpumode assert` checks the whole desired state, and a host it cannot check is never "in mode"."""

from __future__ import annotations

from pathlib import Path

from engine_support import make_host, run_cli

from gpumode.domain import Mode
from gpumode.host.discover import discover
from gpumode.modes import engine, verify

L40S_GPU = "0000:17:00.0"  # l40s-sriov: four L40S-4Q vGPUs (type 1150) on its first VFs
L40S_OTHER = "0000:39:00.0"  # two vGPUs of another type


def test_an_empty_root_is_in_no_mode(tmp_path: Path) -> None:
    (tmp_path / "sys/bus/pci/devices").mkdir(parents=True)
    proc = run_cli("assert", "--mode", "vgpu", "--root", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no GPU to check" in proc.stdout


def test_the_fixture_as_built_is_in_its_mode_with_its_vgpus(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "l40s-sriov")
    assert engine.assert_mode(host, Mode.VGPU) == []
    assert engine.assert_mode(host, Mode.VGPU, [L40S_GPU], vgpu_type="L40S-4Q", vgpu_count=4) == []
    assert engine.assert_mode(host, Mode.VGPU, [L40S_GPU], vgpu_type="1150") == []


def test_a_wrong_vgpu_type_or_count_fails(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "l40s-sriov")
    count = engine.assert_mode(host, Mode.VGPU, [L40S_GPU], vgpu_count=2)
    assert count == [f"{L40S_GPU}: 4 vGPUs, expected 2"]
    wrong = engine.assert_mode(host, Mode.VGPU, [L40S_OTHER], vgpu_type="L40S-4Q")
    assert len(wrong) == 1 and wrong[0].startswith(f"{L40S_OTHER}: vGPUs of type ") and "L40S-4Q" in wrong[0]
    unknown = engine.assert_mode(host, Mode.VGPU, [L40S_GPU], vgpu_type="L40S-5Z")
    assert unknown == [f"{L40S_GPU}: offers no vGPU type 'L40S-5Z'"]
    proc = run_cli(
        "assert", "--mode", "vgpu", "--gpu", L40S_GPU, "--vgpu-type", "L40S-4Q", "--count", "3",
        "--root", str(host.root),
    )  # fmt: skip
    assert proc.returncode == 1 and "4 vGPUs, expected 3" in proc.stdout, proc.stdout + proc.stderr


def test_a_leftover_driver_override_fails(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "l40s-sriov")
    host.write(host.path("sys/bus/pci/devices", L40S_GPU, "driver_override"), "vfio-pci")
    snapshot = discover(host)
    assert snapshot.gpu(L40S_GPU) is not None and snapshot.gpu(L40S_GPU).mode is Mode.VGPU  # type: ignore[union-attr]
    differences = engine.assert_mode(host, Mode.VGPU, [L40S_GPU])
    assert len(differences) == 1 and "driver_override=vfio-pci" in differences[0], differences
    proc = run_cli("assert", "--mode", "vgpu", "--root", str(host.root))
    assert proc.returncode == 1 and "driver_override=vfio-pci" in proc.stdout


def test_vfs_and_orphan_mdevs_outside_vgpu_mode_fail(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "l40s-sriov")
    snapshot = discover(host)
    gpu = snapshot.gpu(L40S_GPU)
    assert gpu is not None
    catalog, _ = engine.EngineConfig().load(host)
    found = verify.differences(host, snapshot, {L40S_GPU: verify.Want(Mode.ACCEL)}, catalog)
    assert any(f"{len(gpu.vfs)} SR-IOV VFs still enabled in mode accel" in d for d in found), found
    assert any("4 vGPUs left in mode accel" in d for d in found), found
    orphan = host.path("sys/bus/mdev/devices", "0e8c1a5e-0000-4000-8000-000000000001")
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.mkdir()  # an mdev whose parent no discovery knows (a stale entry)
    assert orphan.name in verify.orphan_mdevs(host, discover(host))


def test_bad_assert_options_are_refused(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    proc = run_cli("assert", "--mode", "accel", "--count", "2", "--root", str(host.root))
    assert proc.returncode == 2 and "go with --mode vgpu" in proc.stderr
