"""vgpu.py on an emulated vGPU host carrying every vGPU interface there is.

* a T4: mdev types on the physical function (Turing);
* an A16: SR-IOV, each VF an mdev parent (Ampere, vGPU 13–16);
* two L40S: SR-IOV with the vendor interface ``<VF>/nvidia/current_vgpu_type`` (vGPU 17+), one with its VFs
  enabled and a vGPU on its first VF, one with VFs still disabled.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from pathlib import Path

import pytest

from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures.models import A16, L40S, T4, models, vgpu_type
from gpumode.emulated.fixtures.topology import CLASS_PCI_BRIDGE, Board, vf_address
from gpumode.emulated.spec import HostSpec
from gpumode.host import driverops, vgpu
from gpumode.host.root import Host
from gpumode.host.vgpu import VgpuError

T4_GPU = "0000:3b:00.0"
A16_GPU = "0000:5e:00.0"
L40S_BUSY = "0000:86:00.0"
L40S_IDLE = "0000:af:00.0"
L40S_4Q = vgpu_type(L40S, "NVIDIA L40S-4Q").type_id
# The real parts enable 16 (A16) and 32 (L40S) VFs; four show the same interfaces with a much smaller tree.
A16 = dataclasses.replace(A16, sriov_total_vfs=4)
L40S = dataclasses.replace(L40S, sriov_total_vfs=4)
BUSY_VF = vf_address(L40S_BUSY, L40S, 0)


def root_port(board: Board, bus: int, numa: int) -> str:
    """A bare PCIe root port (pcieport) on ``bus``: the fewer functions, the faster the emulated kernel."""
    return board.add(board.addr(bus, 1, 0), 0x8086, 0x352A, CLASS_PCI_BRIDGE, numa=numa, driver="pcieport")


def vgpu_spec() -> HostSpec:
    board = Board()
    for bus, model, numa in ((0x3A, T4, 0), (0x5D, A16, 0), (0x85, L40S, 1), (0xAE, L40S, 1)):
        port = root_port(board, bus, numa)
        board.gpu(board.addr(bus + 1, 0, 0), model, parent=port, numa=numa, driver="nvidia")
    return HostSpec(
        name="vgpu-test",
        description="one GPU per vGPU interface",
        hostname="vgpu-test",
        devices=board.devices,
        gpu_models=models(T4, A16, L40S),
        packages=["nvidia-vgpu-ubuntu-550"],
        modules=["nvidia", "nvidia_vgpu_vfio"],
        services=["nvidia-vgpud", "nvidia-vgpu-mgr"],
        sriov_numvfs={A16_GPU: A16.sriov_total_vfs, L40S_BUSY: L40S.sriov_total_vfs},
        vendor_vgpus={BUSY_VF: L40S_4Q},
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vgpu") / "host"
    create_host(vgpu_spec(), root)
    return root


@pytest.fixture
def shared(pristine: Path) -> Host:
    """The module's one host, for tests that only read (cheaper than a copy)."""
    return Host(pristine)


@pytest.fixture
def host(pristine: Path, tmp_path: Path) -> Host:
    """A fresh copy of the host per test (building it once keeps the suite fast)."""
    shutil.copytree(pristine, tmp_path / "host", symlinks=True)
    return Host(tmp_path / "host")


# --- SR-IOV -------------------------------------------------------------------------------------------------


def test_vfs_are_listed_in_virtfn_order(shared: Host) -> None:
    vfs = vgpu.list_vfs(shared, L40S_BUSY)
    assert len(vfs) == L40S.sriov_total_vfs
    assert vfs[:2] == [BUSY_VF, vf_address(L40S_BUSY, L40S, 1)]
    assert vfs[-1] == vf_address(L40S_BUSY, L40S, 3)
    assert vgpu.vfs_enabled(shared, L40S_BUSY)
    assert not vgpu.vfs_enabled(shared, L40S_IDLE)


def test_enable_and_disable_vfs_through_sriov_manage(host: Host) -> None:
    # sriov-manage rebinds the PF, which needs the unbindLock: nothing may hold the GPU meanwhile.
    driverops.stop_service(host, "nvidia-vgpu-mgr")
    vfs = vgpu.enable_vfs(host, L40S_IDLE)
    assert len(vfs) == L40S.sriov_total_vfs
    assert vgpu.vfs_enabled(host, L40S_IDLE)
    assert vgpu.enable_vfs(host, L40S_IDLE) == vfs  # already on: same VFs, nothing run

    vgpu.disable_vfs(host, L40S_IDLE)
    assert not vgpu.vfs_enabled(host, L40S_IDLE)
    assert vgpu.list_vfs(host, L40S_IDLE) == []
    vgpu.disable_vfs(host, L40S_IDLE)  # already off


def test_disable_vfs_refuses_while_a_vf_carries_a_vgpu(host: Host) -> None:
    with pytest.raises(VgpuError, match=f"still carry vGPUs.*{BUSY_VF}"):
        vgpu.disable_vfs(host, L40S_BUSY)
    assert vgpu.vfs_enabled(host, L40S_BUSY)
    assert vgpu.current_type(host, BUSY_VF) == L40S_4Q


def test_sriov_on_a_gpu_whose_vgpus_are_not_on_vfs_is_a_clear_error(shared: Host) -> None:
    # a T4 has an SR-IOV capability, but sriov-manage leaves it alone (its vGPUs are mdevs on the PF)
    with pytest.raises(VgpuError, match="enabled no VFs"):
        vgpu.enable_vfs(shared, T4_GPU)


# --- vendor interface ---------------------------------------------------------------------------------------


def test_parse_creatable_reads_the_driver_format() -> None:
    text = "ID    : vGPU Name\n1147  : NVIDIA L40S-1Q\n1150  : NVIDIA L40S-4Q\n"
    assert vgpu.parse_creatable(text) == {1147: "NVIDIA L40S-1Q", 1150: "NVIDIA L40S-4Q"}
    assert vgpu.parse_creatable("ID    : vGPU Name\n") == {}


def test_set_and_clear_a_vgpu_type_on_a_vf(host: Host) -> None:
    vf = vf_address(L40S_BUSY, L40S, 2)
    assert vgpu.current_type(host, vf) == 0
    assert vgpu.creatable_types(host, vf)[L40S_4Q] == "NVIDIA L40S-4Q"

    vgpu.set_vgpu_type(host, vf, L40S_4Q)
    assert vgpu.current_type(host, vf) == L40S_4Q
    vgpu.set_vgpu_type(host, vf, L40S_4Q)  # same type: no-op

    other = vgpu_type(L40S, "NVIDIA L40S-8Q").type_id
    with pytest.raises(VgpuError, match="clear it before"):
        vgpu.set_vgpu_type(host, vf, other)

    vgpu.clear_vgpu_type(host, vf)
    assert vgpu.current_type(host, vf) == 0
    vgpu.clear_vgpu_type(host, vf)  # nothing set: no-op, not the driver's EPERM


def test_a_type_the_vf_cannot_take_is_refused_with_the_list(host: Host) -> None:
    vf = vf_address(L40S_BUSY, L40S, 3)
    with pytest.raises(VgpuError, match=r"cannot take vGPU type 999.*NVIDIA L40S-4Q"):
        vgpu.set_vgpu_type(host, vf, 999)
    assert vgpu.current_type(host, vf) == 0


def test_vendor_calls_on_a_pf_say_what_is_wrong(shared: Host) -> None:
    with pytest.raises(VgpuError, match="no nvidia/current_vgpu_type"):
        vgpu.current_type(shared, L40S_BUSY)


# --- mdev ---------------------------------------------------------------------------------------------------


def test_mdev_parents_are_the_pf_on_turing_and_the_vfs_on_ampere(shared: Host) -> None:
    assert vgpu.mdev_parents(shared, T4_GPU) == [T4_GPU]
    assert vgpu.mdev_parents(shared, A16_GPU) == vgpu.list_vfs(shared, A16_GPU)
    assert len(vgpu.mdev_parents(shared, A16_GPU)) == A16.sriov_total_vfs
    assert vgpu.mdev_parents(shared, L40S_BUSY) == []  # vendor interface: no mdev


def test_supported_types_read_sysfs(shared: Host) -> None:
    types = {t.type_id: t for t in vgpu.supported_types(shared, T4_GPU)}
    assert types["nvidia-230"].name == "GRID T4-1Q"
    assert types["nvidia-230"].available_instances == 16
    assert types["nvidia-230"].device_api == "vfio-pci"
    assert [t.type_id for t in vgpu.supported_types(shared, T4_GPU)][:2] == ["nvidia-222", "nvidia-223"]


def test_create_list_and_remove_an_mdev_with_mdevctl_persistence(host: Host) -> None:
    mdev_uuid = vgpu.create_mdev(host, T4_GPU, "nvidia-230")

    mdevs = {m.uuid: (m.parent, m.type_id) for m in vgpu.list_mdevs(host)}
    assert mdevs[mdev_uuid] == (T4_GPU, "nvidia-230")
    saved = json.loads(vgpu.mdev_persistence_file(host, T4_GPU, mdev_uuid).read_text())
    assert saved == {"mdev_type": "nvidia-230", "start": "auto", "attrs": []}
    available = {t.type_id: t.available_instances for t in vgpu.supported_types(host, T4_GPU)}
    assert available["nvidia-230"] == 15

    assert vgpu.create_mdev(host, T4_GPU, "nvidia-230", mdev_uuid) == mdev_uuid  # idempotent

    vgpu.remove_mdev(host, mdev_uuid)
    assert all(m.uuid != mdev_uuid for m in vgpu.list_mdevs(host))
    assert not vgpu.mdev_persistence_file(host, T4_GPU, mdev_uuid).exists()
    vgpu.remove_mdev(host, mdev_uuid)  # gone already: no error


def test_create_mdev_refuses_an_unknown_type_listing_the_offered_ones(host: Host) -> None:
    with pytest.raises(VgpuError, match=r"does not offer vGPU type nvidia-1150.*nvidia-230 \(GRID T4-1Q\)"):
        vgpu.create_mdev(host, T4_GPU, "nvidia-1150")
    assert vgpu.list_mdevs(host) == []


def test_create_mdev_refuses_when_no_instance_is_left(host: Host) -> None:
    parent = vgpu.mdev_parents(host, A16_GPU)[0]  # one vGPU per VF on Ampere
    vgpu.create_mdev(host, parent, "nvidia-714", persist=False)
    with pytest.raises(VgpuError, match=r"no nvidia-714 .* instance left"):
        vgpu.create_mdev(host, parent, "nvidia-714", persist=False)
    assert len(vgpu.list_mdevs(host)) == 1


def test_create_mdev_rejects_a_bad_uuid_and_a_uuid_used_elsewhere(host: Host) -> None:
    with pytest.raises(VgpuError, match="not a UUID"):
        vgpu.create_mdev(host, T4_GPU, "nvidia-230", "not-a-uuid")
    used = vgpu.create_mdev(host, T4_GPU, "nvidia-230", str(uuid.uuid4()))
    with pytest.raises(VgpuError, match="already exists as nvidia-230"):
        vgpu.create_mdev(host, T4_GPU, "nvidia-231", used)


# --- type resolution ----------------------------------------------------------------------------------------


SPELLINGS = ["NVIDIA L40S-4Q", "l40s-4q", f"nvidia-{L40S_4Q}", str(L40S_4Q), L40S_4Q]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_resolve_accepts_every_spelling(shared: Host, spelling: str | int) -> None:
    resolved = vgpu.resolve_vgpu_type(shared, L40S_BUSY, spelling)
    assert (resolved.interface, resolved.type_id, resolved.name) == ("vendor", L40S_4Q, "NVIDIA L40S-4Q")


def test_resolve_on_mdev_gpus(shared: Host) -> None:
    t4 = vgpu.resolve_vgpu_type(shared, T4_GPU, "T4-1Q")
    assert (t4.interface, t4.mdev_type, t4.name) == ("mdev", "nvidia-230", "GRID T4-1Q")
    a16 = vgpu.resolve_vgpu_type(shared, A16_GPU, "A16-4Q")
    assert a16.mdev_type == "nvidia-713"


def test_resolve_unknown_type_lists_what_the_gpu_offers(shared: Host) -> None:
    with pytest.raises(VgpuError, match=r"no vGPU type 'A16-4Q'.*NVIDIA L40S-4Q \(1150\)"):
        vgpu.resolve_vgpu_type(shared, L40S_BUSY, "A16-4Q")


def test_resolve_on_a_gpu_without_vfs_explains_why(shared: Host) -> None:
    with pytest.raises(VgpuError, match="VFs enabled"):
        vgpu.resolve_vgpu_type(shared, L40S_IDLE, "L40S-4Q")


def test_bad_addresses_are_vgpu_errors(shared: Host) -> None:
    with pytest.raises(VgpuError, match="not a PCI address"):
        vgpu.set_vgpu_type(shared, "86:00", L40S_4Q)
    with pytest.raises(VgpuError, match="no PCI device"):
        vgpu.resolve_vgpu_type(shared, "0000:99:00.0", "L40S-4Q")
