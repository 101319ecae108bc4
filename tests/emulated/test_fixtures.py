"""Every fixture builds, has the stated shape and driver state, and real tools read it as a real host."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpumode.cli.main import app
from gpumode.domain import CLASS_NVSWITCH
from gpumode.emulated.create import CreateError, create_host
from gpumode.emulated.fixtures import (
    FIXTURES,
    UnknownFixtureError,
    get_fixture,
    gpu_addresses,
    starting_mode,
)
from gpumode.emulated.hypervisor import EmulatedHypervisor
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.emulated.spec import HostSpec
from gpumode.host.root import Host


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Host]]:
    """Each fixture built once for this module (building the big ones takes seconds); tests only read them."""
    base = tmp_path_factory.mktemp("fixtures")
    yield {name: create_host(name, base / name) for name in FIXTURES}
    shutil.rmtree(base, ignore_errors=True)


def driver_of(host: Host, address: str) -> str | None:
    link = host.path("sys/bus/pci/devices", address, "driver")
    return os.path.basename(os.readlink(link)) if os.path.lexists(link) else None


def test_registry_and_unknown_names() -> None:
    assert set(FIXTURES) == {"hgx-h100", "a16-vdi", "l40s-sriov", "t4-mdev", "rtx-workstation", "a2-r580"}
    with pytest.raises(UnknownFixtureError, match="valid fixtures: a16-vdi, a2-r580, hgx-h100"):
        get_fixture("h100")


@pytest.mark.parametrize(
    ("name", "gpus", "mode"),
    [
        ("hgx-h100", 8, "accel"),
        ("a16-vdi", 8, "vgpu"),
        ("l40s-sriov", 4, "vgpu"),
        ("t4-mdev", 4, "none"),
        ("rtx-workstation", 1, "passthrough"),
        ("a2-r580", 2, "vgpu"),
    ],
)
def test_spec_shape(name: str, gpus: int, mode: str) -> None:
    spec = get_fixture(name)
    assert len(gpu_addresses(spec)) == gpus
    assert starting_mode(spec) == mode
    addresses = [d.address for d in spec.devices]
    assert len(addresses) == len(set(addresses))
    assert all(d.iommu_group is not None for d in spec.devices)


def test_hgx_h100_is_a_real_server_board(built: dict[str, Host]) -> None:
    spec = get_fixture("hgx-h100")
    assert len(spec.devices) >= 150
    gpus = [d for d in spec.devices if d.address in gpu_addresses(spec)]
    assert {(d.vendor, d.device, d.subsystem_device) for d in gpus} == {(0x10DE, 0x2330, 0x16C1)}
    assert sum(d.class_code == CLASS_NVSWITCH for d in spec.devices) == 4
    assert {d.numa_node for d in gpus} == {0, 1}
    vendors = {d.vendor for d in spec.devices}
    assert {0x1000, 0x15B3, 0x144D, 0x1A03, 0x8086} <= vendors  # PEX, ConnectX-7, NVMe, BMC VGA, Intel
    by_address = {d.address: d for d in spec.devices}
    for gpu in gpus:  # each GPU behind its own PEX switch (downstream port -> upstream port -> root port)
        down = by_address[gpu.parent or ""]
        assert (down.vendor, down.device) == (0x1000, 0xC030)
        assert (by_address[down.parent or ""].vendor, by_address[down.parent or ""].device) == (
            0x1000,
            0xC030,
        )
    host = built["hgx-h100"]
    assert all(driver_of(host, d.address) == "nvidia" for d in gpus)
    assert host.run(["systemctl", "is-active", "nvidia-persistenced", "nvidia-fabricmanager"]).ok
    holders = {(h.holder, h.target) for h in EmulatedKernel(host.root).handles()}
    assert {("nvidia-persistenced.service", d.address) for d in gpus} <= holders
    assert host.run(["rmmod", "nvidia"]).returncode == 1


def test_a16_vdi_runs_mdev_vgpus_on_vfs(built: dict[str, Host]) -> None:
    host = built["a16-vdi"]
    spec = get_fixture("a16-vdi")
    for gpu in gpu_addresses(spec):
        assert host.path("sys/bus/pci/devices", gpu, "sriov_numvfs").read_text() == "16\n"
    vf = host.path("sys/bus/pci/devices/0000:33:00.4")
    assert (vf / "physfn").exists() and (vf / "mdev_supported_types/nvidia-713/name").read_text() == (
        "NVIDIA A16-4Q\n"
    )
    mdevs = sorted(os.listdir(host.path("sys/bus/mdev/devices")))
    assert len(mdevs) == 14
    running = [vm for vm in EmulatedHypervisor(host).list_vms() if vm.running and vm.devices]
    held = {h.target for h in EmulatedKernel(host.root).handles() if h.kind == "mdev"}
    assert held == {d.id for vm in running for d in vm.devices} and len(held) == 11
    assert host.run(["systemctl", "is-active", "nvidia-vgpu-mgr"]).ok
    assert "Host VGPU Mode                    : SR-IOV" in host.run(["nvidia-smi", "-q"]).stdout


def test_l40s_sriov_uses_the_vendor_interface(built: dict[str, Host]) -> None:
    host = built["l40s-sriov"]
    vf = host.path("sys/bus/pci/devices/0000:17:00.4")
    assert (vf / "nvidia/current_vgpu_type").read_text() == "1150\n"
    creatable = (host.path("sys/bus/pci/devices/0000:17:01.4") / "nvidia/creatable_vgpu_types").read_text()
    assert creatable.startswith("ID    : vGPU Name\n") and "NVIDIA L40S-4Q" in creatable
    assert not host.path("sys/class/mdev_bus").exists() or not os.listdir(host.path("sys/class/mdev_bus"))
    vms = {vm.name: vm for vm in EmulatedHypervisor(host).list_vms()}
    assert vms["render-01"].running and vms["render-01"].devices[0].id == "0000:17:00.4"
    assert not vms["sim-02"].running
    with pytest.raises(OSError):
        host.write(vf / "nvidia/current_vgpu_type", "0")  # held by render-01


def test_a2_r580_on_6_8_uses_the_vendor_framework_and_no_mdev(built: dict[str, Host]) -> None:
    host = built["a2-r580"]
    pf = host.path("sys/bus/pci/devices/0000:17:00.0")
    assert (pf / "subsystem_device").read_text() == "0x157e\n" and (pf / "sriov_numvfs").read_text() == "16\n"
    vf = host.path("sys/bus/pci/devices/0000:17:00.4")
    assert (vf / "subsystem_vendor").read_text() == "0x10de\n" and (
        vf / "subsystem_device"
    ).read_text() == "0x0000\n"
    assert (vf / "nvidia/current_vgpu_type").read_text() == "746\n"  # NVIDIA A2-4Q
    idle = host.path("sys/bus/pci/devices/0000:31:00.4/nvidia/creatable_vgpu_types").read_text()
    assert "742   : NVIDIA A2-1B\n" in idle and "A16" not in idle
    assert not (vf / "mdev_supported_types").exists()
    assert not host.path("sys/class/mdev_bus").exists() or not os.listdir(host.path("sys/class/mdev_bus"))
    assert "580.65.05" in host.path("proc/driver/nvidia/version").read_text()
    assert host.path("proc/sys/kernel/osrelease").read_text().startswith("6.8.")


def test_t4_has_an_sriov_capability_but_vgpus_on_the_pf(built: dict[str, Host]) -> None:
    host = built["t4-mdev"]
    gpu = host.path("sys/bus/pci/devices", gpu_addresses(get_fixture("t4-mdev"))[0])
    assert (gpu / "sriov_totalvfs").read_text() == "16\n" and (gpu / "sriov_numvfs").read_text() == "0\n"


def test_t4_mdev_has_no_driver(built: dict[str, Host]) -> None:
    host = built["t4-mdev"]
    assert all(driver_of(host, gpu) is None for gpu in gpu_addresses(get_fixture("t4-mdev")))
    assert host.run(["dpkg-query", "-W", "nvidia-driver-550-server"]).returncode == 1
    assert host.run(["nvidia-smi"]).returncode == 127
    assert "nvidia" not in EmulatedKernel(host.root).loaded_modules()


def test_rtx_workstation_shares_one_iommu_group(built: dict[str, Host]) -> None:
    host = built["rtx-workstation"]
    group = host.path("sys/bus/pci/devices/0000:01:00.0/iommu_group").resolve()
    members = sorted(os.listdir(group / "devices"))
    assert members == ["0000:00:01.0", "0000:01:00.0", "0000:01:00.1", "0000:01:00.2", "0000:01:00.3"]
    for fn in ("0000:01:00.1", "0000:01:00.2", "0000:01:00.3"):  # audio, USB, UCSI: all linked to the GPU
        assert os.path.lexists(host.path(f"sys/bus/pci/devices/0000:01:00.0/consumer:pci:{fn}"))
    for fn in members[1:]:
        assert driver_of(host, fn) == "vfio-pci"
        assert host.path("sys/bus/pci/devices", fn, "driver_override").read_text() == "vfio-pci\n"
    assert host.run(["driverctl", "list-overrides"]).stdout.count("vfio-pci") == 4
    assert {h.holder for h in EmulatedKernel(host.root).handles()} == {"qemu:win11-cad"}


LSPCI = shutil.which("lspci")
_LSPCI_LINE = re.compile(r"^(\S+) .*\[([0-9a-f]{4}):([0-9a-f]{4})\]")


@pytest.mark.skipif(LSPCI is None, reason="pciutils (lspci) is not installed")
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_lspci_reads_every_function(built: dict[str, Host], name: str) -> None:
    host = built[name]
    proc = subprocess.run(
        [str(LSPCI), "-D", "-nn", "-k", "-A", "linux-sysfs", "-O", f"sysfs.path={host.root}/sys/bus/pci"],
        capture_output=True,
        text=True,
        check=True,
    )
    seen: dict[str, tuple[int, int, str | None]] = {}
    current = ""
    for line in proc.stdout.splitlines():
        match = _LSPCI_LINE.match(line)
        if match:
            current = match.group(1)
            seen[current] = (int(match.group(2), 16), int(match.group(3), 16), None)
        elif line.strip().startswith("Kernel driver in use:"):
            vendor, device, _ = seen[current]
            seen[current] = (vendor, device, line.split(":", 1)[1].strip())
    state = EmulatedKernel(host.root).snapshot()
    expected = {d.address: (d.vendor, d.device, d.driver) for d in state.present_devices()}
    assert seen == expected
    assert len([d for d in state.present_devices() if not d.is_vf]) == len(get_fixture(name).devices)


def test_create_refuses_a_non_empty_directory_and_bad_specs(tmp_path: Path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(CreateError, match="not an empty directory"):
        create_host("t4-mdev", tmp_path / "busy")
    spec: HostSpec = get_fixture("t4-mdev")
    spec.packages = ["nvidia-driver-550-server", "nvidia-vgpu-ubuntu-550"]
    with pytest.raises(CreateError, match="conflict"):
        create_host(spec, tmp_path / "both")
    spec = get_fixture("t4-mdev")
    spec.services = ["nvidia-persistenced"]  # no package ships it here
    with pytest.raises(CreateError, match="nvidia-persistenced"):
        create_host(spec, tmp_path / "nosvc")
    assert not (tmp_path / "nosvc").exists()


def test_cli_list_and_create(tmp_path: Path) -> None:
    runner = CliRunner()
    listing = runner.invoke(app, ["emulate", "list"])
    assert listing.exit_code == 0
    assert all(name in listing.output for name in FIXTURES)
    bad = runner.invoke(app, ["emulate", "create", "nope", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "valid fixtures:" in bad.output
    made = runner.invoke(app, ["emulate", "create", "rtx-workstation", str(tmp_path / "ws")])
    assert made.exit_code == 0, made.output
    assert f"gpumode discover --root {tmp_path / 'ws'}" in made.output
    assert Host(tmp_path / "ws").emulated


@pytest.mark.skipif(LSPCI is None, reason="pciutils (lspci) is not installed")
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_lspci_reads_the_capabilities_of_every_gpu(built: dict[str, Host], name: str) -> None:
    """PCI Express, power management and MSI-X on every GPU; SR-IOV (with NVIDIA's offset 4, stride 1) on
    every GPU whose model has the capability."""
    host = built[name]
    spec = get_fixture(name)
    for dev in (d for d in spec.devices if d.address in gpu_addresses(spec)):
        out = subprocess.run(
            [
                str(LSPCI),
                "-vvv",
                "-s",
                dev.address,
                "-A",
                "linux-sysfs",
                "-O",
                f"sysfs.path={host.root}/sys/bus/pci",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "Express (v2) Endpoint" in out and "MSI-X: Enable- Count=10" in out, out
        assert "Power Management version 3" in out
        model = spec.gpu_models[dev.gpu_model or ""]
        if model.sriov_total_vfs:
            assert "Single Root I/O Virtualization (SR-IOV)" in out
            assert f"Total VFs: {model.sriov_total_vfs}," in out and "VF offset: 4, stride: 1" in out
        else:
            assert "SR-IOV" not in out
