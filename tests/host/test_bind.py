"""bind.py on an emulated host whose kernel answers driver_override / unbind / drivers_probe as Linux does.

The board: a Quadro RTX 6000 whose IOMMU group holds the GPU, its HDMI audio, a USB controller and a UCSI
function (the case that leaves QEMU with "group not viable" when only the GPU moves); an L40S behind a PCIe
switch port that shares its group (no ACS), so a bridge is in the group; and a T4 alone in its group.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures.models import L40S, RTX6000, T4, models
from gpumode.emulated.fixtures.topology import (
    CLASS_HDA,
    CLASS_PCI_BRIDGE,
    CLASS_SERIAL_OTHER,
    CLASS_XHCI,
    NVIDIA,
    Board,
)
from gpumode.emulated.spec import HostSpec
from gpumode.host import bind
from gpumode.host.bind import BindError
from gpumode.host.driverops import module_loaded
from gpumode.host.root import Host

RTX = "0000:17:00.0"
RTX_AUDIO, RTX_USB, RTX_UCSI = "0000:17:00.1", "0000:17:00.2", "0000:17:00.3"
L40S_GPU = "0000:3a:00.0"
SWITCH_PORT = "0000:39:00.0"
T4_GPU = "0000:5e:00.0"



def root_port(board: Board, bus: int, numa: int) -> str:
    """A bare PCIe root port (pcieport) on ``bus``: the fewer functions, the faster the emulated kernel."""
    return board.add(board.addr(bus, 1, 0), 0x8086, 0x352A, CLASS_PCI_BRIDGE, numa=numa, driver="pcieport")

def board_spec(*, services: list[str] | None = None, iommu: bool = True) -> HostSpec:
    board = Board()
    a = board.addr
    port = root_port(board, 0x16, 0)
    group = board.new_group()
    board.add(
        RTX,
        NVIDIA,
        RTX6000.device,
        RTX6000.class_code,
        parent=port,
        numa=0,
        driver="nvidia",
        group=group,
        subsystem=(NVIDIA, RTX6000.subsystem_device),
        revision=RTX6000.revision,
        gpu_model=RTX6000.key,
        consumers=(RTX_AUDIO,),
    )
    board.add(RTX_AUDIO, NVIDIA, 0x10F7, CLASS_HDA, parent=port, numa=0, driver="snd_hda_intel", group=group)
    board.add(RTX_USB, NVIDIA, 0x1AD6, CLASS_XHCI, parent=port, numa=0, driver="xhci_hcd", group=group)
    board.add(RTX_UCSI, NVIDIA, 0x1AD7, CLASS_SERIAL_OTHER, parent=port, numa=0, group=group)

    port = root_port(board, 0x37, 0)
    shared = board.new_group()
    board.add(
        SWITCH_PORT, 0x1000, 0xC030, CLASS_PCI_BRIDGE, parent=port, numa=0, driver="pcieport", group=shared
    )
    board.add(
        L40S_GPU,
        NVIDIA,
        L40S.device,
        L40S.class_code,
        parent=SWITCH_PORT,
        numa=0,
        driver="nvidia",
        group=shared,
        subsystem=(NVIDIA, L40S.subsystem_device),
        gpu_model=L40S.key,
    )

    port = root_port(board, 0x5D, 1)
    board.gpu(T4_GPU, T4, parent=port, numa=1, driver="nvidia")
    assert a(0x17, 0, 0) == RTX
    return HostSpec(
        name="bind-test",
        description="GPUs with companions and bridges in their IOMMU groups",
        hostname="bind-test",
        devices=board.devices,
        gpu_models=models(RTX6000, L40S, T4),
        iommu=iommu,
        packages=["nvidia-driver-550-server"],
        modules=["nvidia", "snd_hda_intel", "xhci_pci"],
        services=services or [],
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[tuple[str, ...], bool], Path]:
    return {}  # each host shape is built once per module, then copied: building is the slow part


@pytest.fixture
def make_host(
    pristine: dict[tuple[tuple[str, ...], bool], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Host]:
    def make(*, services: tuple[str, ...] = (), iommu: bool = True) -> Host:
        key = (services, iommu)
        if key not in pristine:
            pristine[key] = tmp_path_factory.mktemp("pristine") / "host"
            create_host(board_spec(services=list(services), iommu=iommu), pristine[key])
        target = tmp_path_factory.mktemp("bind") / "host"
        shutil.copytree(pristine[key], target, symlinks=True)
        return Host(target)

    return make


@pytest.fixture
def host(make_host: Callable[..., Host]) -> Host:
    return make_host()


def drivers(host: Host, *addresses: str) -> dict[str, str | None]:
    return {a: bind.current_driver(host, a) for a in addresses}


def test_group_members_include_companions_and_bridges_but_vfio_members_skip_bridges(host: Host) -> None:
    assert bind.iommu_group_members(host, RTX) == [RTX, RTX_AUDIO, RTX_USB, RTX_UCSI]
    assert bind.iommu_group_members(host, "3a:00.0") == [SWITCH_PORT, L40S_GPU]
    assert bind.vfio_members(host, L40S_GPU) == [L40S_GPU]
    assert bind.consumers(host, RTX) == [RTX_AUDIO]
    assert bind.current_driver(host, RTX_UCSI) is None
    assert bind.current_driver(host, RTX) == "nvidia"


def test_bind_moves_the_whole_group_loads_vfio_and_persists(host: Host) -> None:
    assert not module_loaded(host, "vfio_pci")
    assert not bind.is_bound_to_vfio(host, RTX)

    before = bind.bind_to_vfio(host, RTX)

    assert before == {RTX: "nvidia", RTX_AUDIO: "snd_hda_intel", RTX_USB: "xhci_hcd", RTX_UCSI: None}
    assert module_loaded(host, "vfio_pci")
    assert bind.is_bound_to_vfio(host, RTX)
    for member in before:
        assert bind.current_driver(host, member) == "vfio-pci"
        assert bind.driver_override(host, member) == "vfio-pci"
        assert bind.persistence_file(host, member).read_text() == "vfio-pci\n"
    # the other GPUs are untouched
    assert drivers(host, L40S_GPU, T4_GPU) == {L40S_GPU: "nvidia", T4_GPU: "nvidia"}


def test_bind_twice_is_a_no_op(host: Host) -> None:
    bind.bind_to_vfio(host, T4_GPU)
    again = bind.bind_to_vfio(host, T4_GPU)
    assert again == {T4_GPU: "vfio-pci"}
    assert bind.is_bound_to_vfio(host, T4_GPU)


def test_bridge_in_the_group_stays_on_pcieport(host: Host) -> None:
    before = bind.bind_to_vfio(host, L40S_GPU, persist=False)
    assert before == {L40S_GPU: "nvidia"}
    assert bind.current_driver(host, SWITCH_PORT) == "pcieport"
    assert bind.is_bound_to_vfio(host, L40S_GPU)
    assert not bind.persistence_file(host, L40S_GPU).exists()


def test_release_puts_every_function_back_and_forgets_the_override(host: Host) -> None:
    before = bind.bind_to_vfio(host, RTX)

    after = bind.release_from_vfio(host, RTX, before)

    assert after == before
    for member in before:
        assert bind.driver_override(host, member) is None
        assert (host.path("sys/bus/pci/devices", member, "driver_override").read_text()) == "(null)\n"
        assert not bind.persistence_file(host, member).exists()
    assert not bind.is_bound_to_vfio(host, RTX)


def test_release_without_a_record_lets_the_kernel_probe(host: Host) -> None:
    bind.bind_to_vfio(host, T4_GPU)
    assert bind.release_from_vfio(host, T4_GPU, {}) == {T4_GPU: "nvidia"}


def test_busy_gpu_is_refused_with_the_services_to_stop(make_host: Callable[..., Host]) -> None:
    host = make_host(services=("nvidia-persistenced",))

    with pytest.raises(BindError, match=r"in use.*nvidia-persistenced"):
        bind.bind_to_vfio(host, T4_GPU)

    assert bind.current_driver(host, T4_GPU) == "nvidia"
    assert bind.driver_override(host, T4_GPU) is None
    assert not bind.persistence_file(host, T4_GPU).exists()


def test_failure_midway_puts_back_what_was_moved(make_host: Callable[..., Host]) -> None:
    """The RTX's audio moves first; the GPU is held, so the group must come back as it was."""
    host = make_host(services=("nvidia-persistenced",))

    with pytest.raises(BindError):
        bind.bind_to_vfio(host, RTX)

    assert drivers(host, RTX, RTX_AUDIO, RTX_USB, RTX_UCSI) == {
        RTX: "nvidia",
        RTX_AUDIO: "snd_hda_intel",
        RTX_USB: "xhci_hcd",
        RTX_UCSI: None,
    }
    assert all(bind.driver_override(host, m) is None for m in (RTX, RTX_AUDIO, RTX_USB, RTX_UCSI))


def test_no_iommu_is_refused(make_host: Callable[..., Host]) -> None:
    host = make_host(iommu=False)
    with pytest.raises(BindError, match="no IOMMU group"):
        bind.bind_to_vfio(host, T4_GPU)
    assert bind.current_driver(host, T4_GPU) == "nvidia"


@pytest.mark.parametrize(("address", "message"), [("3b:00", "not a PCI address"), ("0000:99:00.0", "no PCI")])
def test_bad_addresses_are_clear_errors(host: Host, address: str, message: str) -> None:
    with pytest.raises(BindError, match=message):
        bind.bind_to_vfio(host, address)


def test_release_rejects_a_bad_record_before_touching_anything(host: Host) -> None:
    bind.bind_to_vfio(host, T4_GPU)
    with pytest.raises(BindError, match="bad address"):
        bind.release_from_vfio(host, T4_GPU, {"nonsense": "nvidia"})
    assert bind.is_bound_to_vfio(host, T4_GPU)


def test_release_from_nvidia_unbinds_an_idle_gpu_and_ignores_others(host: Host) -> None:
    bind.release_from_nvidia(host, T4_GPU)
    assert bind.current_driver(host, T4_GPU) is None
    bind.release_from_nvidia(host, T4_GPU)  # not on nvidia any more: nothing to do
    assert bind.current_driver(host, T4_GPU) is None
