"""driverops.py: modules, services and packages on an emulated host (its userspace answers modprobe, systemctl
and apt-get as the real tools do), plus the parsers on hand-written files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures.models import T4, models
from gpumode.emulated.fixtures.topology import CLASS_PCI_BRIDGE, Board
from gpumode.emulated.spec import HostSpec
from gpumode.host import driverops
from gpumode.host.driverops import DriverOpError
from gpumode.host.root import CommandError, Host

DC = "nvidia-driver-550-server"
VGPU = "nvidia-vgpu-ubuntu-550"



def root_port(board: Board, bus: int, numa: int) -> str:
    """A bare PCIe root port (pcieport) on ``bus``: the fewer functions, the faster the emulated kernel."""
    return board.add(board.addr(bus, 1, 0), 0x8086, 0x352A, CLASS_PCI_BRIDGE, numa=numa, driver="pcieport")

def spec(*, packages: list[str], modules: list[str], services: list[str]) -> HostSpec:
    board = Board()
    port = root_port(board, 0x3A, 0)
    driver = "nvidia" if "nvidia" in modules else None
    board.gpu(board.addr(0x3B, 0, 0), T4, parent=port, numa=0, driver=driver)
    return HostSpec(
        name="driverops-test",
        description="one T4",
        hostname="driverops-test",
        devices=board.devices,
        gpu_models=models(T4),
        packages=packages,
        modules=modules,
        services=services,
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each host shape built once per module (building is the slow part); tests get copies."""
    shapes = {
        # the data-center driver installed, loaded and its persistence daemon running
        "accel": spec(packages=[DC], modules=["nvidia", "nvidia_uvm"], services=["nvidia-persistenced"]),
        # no NVIDIA driver at all
        "bare": spec(packages=[], modules=[], services=[]),
    }
    built = {}
    for name, shape in shapes.items():
        built[name] = tmp_path_factory.mktemp(name) / "host"
        create_host(shape, built[name])
    return built


def copy_of(pristine: dict[str, Path], name: str, tmp_path: Path) -> Host:
    shutil.copytree(pristine[name], tmp_path / name, symlinks=True)
    return Host(tmp_path / name)


@pytest.fixture
def accel(pristine: dict[str, Path], tmp_path: Path) -> Host:
    return copy_of(pristine, "accel", tmp_path)


@pytest.fixture
def bare(pristine: dict[str, Path], tmp_path: Path) -> Host:
    return copy_of(pristine, "bare", tmp_path)


# --- parsers on plain files ---------------------------------------------------------------------------------


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_proc_modules_parsing(tmp_path: Path) -> None:
    write(
        tmp_path,
        "proc/modules",
        "nvidia_uvm 1564672 0 - Live 0x0000000000000000 (POE)\n"
        "nvidia 56233984 3 nvidia_uvm,nvidia_modeset, Live 0x0000000000000000 (POE)\n"
        "vfio 69632 0 [permanent], Live 0x0000000000000000\n",
    )
    mods = driverops.loaded_modules(Host(tmp_path))
    assert mods["nvidia"].users == ["nvidia_uvm", "nvidia_modeset"]
    assert mods["nvidia"].refcount == 3
    assert mods["nvidia_uvm"].users == []
    assert driverops.module_loaded(Host(tmp_path), "nvidia-uvm")  # dash spelling is the same module
    with pytest.raises(DriverOpError, match="used by nvidia_uvm, nvidia_modeset"):
        driverops.unload_module(Host(tmp_path), "nvidia")
    with pytest.raises(DriverOpError, match="permanent"):
        driverops.unload_module(Host(tmp_path), "vfio")


def test_dpkg_status_parsing_counts_only_installed_packages(tmp_path: Path) -> None:
    write(
        tmp_path,
        "var/lib/dpkg/status",
        "Package: nvidia-driver-550-server\nStatus: install ok installed\nVersion: 550.127.05-0ubuntu1\n"
        "Description: driver\n multi-line description\n continued: with a colon\n\n"
        "Package: nvidia-vgpu-ubuntu-550\nStatus: deinstall ok config-files\nVersion: 550.127.06\n\n"
        "Package: half\nStatus: install ok half-configured\nVersion: 1\n",
    )
    host = Host(tmp_path)
    assert driverops.installed_packages(host) == {"nvidia-driver-550-server": "550.127.05-0ubuntu1"}
    assert driverops.package_installed(host, "nvidia-driver-550-server")
    assert not driverops.package_installed(host, "nvidia-vgpu-ubuntu-550")
    assert not driverops.package_installed(host, "half")


@pytest.mark.parametrize("name", ["-o Dpkg::Options", "Nvidia", "a b", ""])
def test_bad_package_names_are_refused_before_running_anything(tmp_path: Path, name: str) -> None:
    with pytest.raises(DriverOpError, match="not package names"):
        driverops.install_packages(Host(tmp_path), [name])


def test_unknown_installer_and_bad_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DriverOpError, match=r"unknown installer 'yum'.*apt, dnf"):
        driverops.install_packages(Host(tmp_path), ["nvidia-driver-550-server"], installer="yum")
    with pytest.raises(DriverOpError, match="not a kernel module name"):
        driverops.load_module(Host(tmp_path), "nvidia; reboot")
    with pytest.raises(DriverOpError, match="not a systemd unit name"):
        driverops.start_service(Host(tmp_path), "--now")
    with pytest.raises(DriverOpError, match="not a command"):
        driverops.run_command(Host(tmp_path), [])


# --- the emulated host --------------------------------------------------------------------------------------


def test_unload_refuses_while_used_and_names_the_users(accel: Host) -> None:
    with pytest.raises(DriverOpError, match=r"nvidia is used by .*nvidia_uvm"):
        driverops.unload_module(accel, "nvidia")
    assert driverops.module_loaded(accel, "nvidia")


def test_unload_refuses_while_a_service_holds_the_gpu(accel: Host) -> None:
    driverops.unload_module(accel, "nvidia_uvm")
    # the holder is named (from its /proc/<pid>/fd), not just counted in refcnt
    with pytest.raises(DriverOpError, match=r"in use: nvidia-persiste \(pid \d+\) has /dev/nvidia0 open"):
        driverops.unload_module(accel, "nvidia")


def test_stop_services_then_unload_then_load_again(accel: Host) -> None:
    assert driverops.service_active(accel, "nvidia-persistenced")
    driverops.stop_service(accel, "nvidia-persistenced")
    assert not driverops.service_active(accel, "nvidia-persistenced.service")
    driverops.stop_service(accel, "nvidia-persistenced")  # already stopped

    driverops.unload_module(accel, "nvidia_uvm")
    driverops.unload_module(accel, "nvidia")
    assert not driverops.module_loaded(accel, "nvidia")
    driverops.unload_module(accel, "nvidia")  # already gone

    driverops.load_module(accel, "nvidia")
    assert driverops.module_loaded(accel, "nvidia")
    driverops.start_service(accel, "nvidia-persistenced")
    assert driverops.service_active(accel, "nvidia-persistenced")


def test_install_and_remove_packages(bare: Host) -> None:
    assert driverops.install_packages(bare, [DC]) == [DC]
    assert driverops.package_installed(bare, DC)
    assert driverops.install_packages(bare, [DC]) == []  # already there: nothing run

    assert driverops.remove_packages(bare, [DC, VGPU]) == [DC]
    assert not driverops.package_installed(bare, DC)
    assert driverops.remove_packages(bare, [DC]) == []


def test_conflicting_install_raises_with_the_command_and_its_stderr(accel: Host) -> None:
    with pytest.raises(CommandError) as caught:
        driverops.install_packages(accel, [VGPU])
    assert caught.value.result.argv[:2] == ("apt-get", "install")
    assert VGPU in caught.value.result.argv
    assert caught.value.result.stderr
    assert not driverops.package_installed(accel, VGPU)


def test_loading_a_module_that_is_not_installed_fails_with_modprobe_output(bare: Host) -> None:
    with pytest.raises(CommandError, match="modprobe nvidia"):
        driverops.load_module(bare, "nvidia")


def test_run_command_returns_the_result_and_raises_on_failure(bare: Host) -> None:
    assert driverops.run_command(bare, ["modprobe", "vfio-pci"]).ok
    assert driverops.module_loaded(bare, "vfio_pci")
    with pytest.raises(CommandError):
        driverops.run_command(bare, ["modprobe", "no_such_module"])
