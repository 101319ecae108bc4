"""The emulated userspace answers commands as the real tools do, through the emulated kernel."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures.mini import L40S, T4, mini_host
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.emulated.userspace import inject_command_fault, read_command_log
from gpumode.host.root import Host

GPU = "0000:10:00.0"


def make(tmp_path: Path, state: str, **kw: object) -> Host:
    return create_host(mini_host(state, **kw), tmp_path / "host")  # type: ignore[arg-type]


def loaded(host: Host) -> list[str]:
    return EmulatedKernel(host.root).loaded_modules()


# --- unknown commands, the log and faults -----------------------------------------------------------------


def test_unknown_command_is_127_and_logged(tmp_path: Path) -> None:
    host = make(tmp_path, "none")
    result = host.run(["frobnicate", "--now"])
    assert (result.returncode, result.stderr) == (127, "frobnicate: command not found\n")
    log = read_command_log(host.root)
    assert log[-1]["argv"] == ["frobnicate", "--now"] and log[-1]["returncode"] == 127


def test_tool_of_an_uninstalled_package_is_not_found(tmp_path: Path) -> None:
    host = make(tmp_path, "none")
    assert host.run(["nvidia-smi"]).returncode == 127
    assert host.run(["/usr/lib/nvidia/sriov-manage", "-e", "ALL"]).returncode == 127


def test_fault_fails_matching_command_once_and_changes_nothing(tmp_path: Path) -> None:
    host = make(tmp_path, "none")
    inject_command_fault(host.root, "apt-get install", returncode=100, stderr="E: mirror down\n")
    first = host.run(["apt-get", "install", "-y", "nvidia-driver-550-server"])
    assert (first.returncode, first.stderr) == (100, "E: mirror down\n")
    assert "nvidia-driver-550-server" not in (host.root / "var/lib/dpkg/status").read_text()
    second = host.run(["apt-get", "install", "-y", "nvidia-driver-550-server"])
    assert second.ok, second.stderr
    assert [e["fault"] for e in read_command_log(host.root)[-2:]] == [True, False]
    assert not (host.root / ".gpumode-emulated/faults.json").exists()


def test_fault_prefix_must_match_words_and_count_is_kept(tmp_path: Path) -> None:
    host = make(tmp_path, "none")
    inject_command_fault(host.root, "modprobe vfio_pci", returncode=1, count=2)
    assert host.run(["modprobe", "vfio-pci"]).ok  # different word: no match
    assert host.run(["modprobe", "vfio_pci"]).returncode == 1
    faults = json.loads((host.root / ".gpumode-emulated/faults.json").read_text())
    assert faults["modprobe vfio_pci"]["count"] == 1


def test_bad_fault_is_refused(tmp_path: Path) -> None:
    host = make(tmp_path, "none")
    with pytest.raises(ValueError, match="must fail"):
        inject_command_fault(host.root, "true", returncode=0)


# --- packages ---------------------------------------------------------------------------------------------


def test_installing_the_other_flavour_conflicts_like_dpkg(tmp_path: Path) -> None:
    host = make(tmp_path, "accel")
    before = (host.root / "var/lib/dpkg/status").read_text()
    result = host.run(["apt-get", "install", "-y", "nvidia-vgpu-ubuntu-550"])
    assert result.returncode == 100
    assert " nvidia-vgpu-ubuntu-550 conflicts with nvidia-driver-550-server" in result.stderr
    assert "E: Sub-process /usr/bin/dpkg returned an error code (1)" in result.stderr
    assert (host.root / "var/lib/dpkg/status").read_text() == before
    assert not (host.root / "usr/lib/nvidia/sriov-manage").exists()


def test_install_writes_dpkg_status_units_and_modules(tmp_path: Path) -> None:
    host = make(tmp_path, "none")
    result = host.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "nvidia-fabricmanager-550"]
    )
    assert result.ok, result.stderr
    status = (host.root / "var/lib/dpkg/status").read_text()
    assert (
        "Package: nvidia-driver-550-server\nStatus: install ok installed\n" in status
    )  # pulled in as a dependency
    assert "Conflicts: nvidia-vgpu-ubuntu-550" in status
    assert os.path.lexists(
        host.root / "etc/systemd/system/multi-user.target.wants/nvidia-persistenced.service"
    )
    assert host.run(["modinfo", "-F", "version", "nvidia"]).stdout == "550.127.05\n"
    query = host.run(["dpkg-query", "-W", "-f", "${Package} ${Version}\\n", "nvidia-fabricmanager-550"])
    assert query.stdout == "nvidia-fabricmanager-550 550.127.05-1\n"


def test_unknown_package(tmp_path: Path) -> None:
    host = make(tmp_path, "none")
    result = host.run(["apt-get", "install", "-y", "nvidia-driver-999"])
    assert (result.returncode, result.stderr) == (100, "E: Unable to locate package nvidia-driver-999\n")


def test_remove_stops_services_but_leaves_modules_loaded(tmp_path: Path) -> None:
    host = make(tmp_path, "accel")
    result = host.run(["apt-get", "purge", "-y", "nvidia-driver-550-server"])
    assert result.ok, result.stderr
    assert "nvidia" in loaded(host)
    assert host.run(["systemctl", "is-active", "nvidia-persistenced"]).returncode == 3
    assert "nvidia-driver-550-server" not in (host.root / "var/lib/dpkg/status").read_text()
    assert host.run(["modinfo", "nvidia"]).returncode == 1  # the .ko is gone, the module stays in memory
    assert host.run(["modprobe", "-r", "nvidia_uvm", "nvidia"]).ok


def test_remove_keeps_config_files_stanza(tmp_path: Path) -> None:
    host = make(tmp_path, "accel", services=False)
    assert host.run(["apt-get", "remove", "-y", "nvidia-driver-550-server"]).ok
    assert "Status: deinstall ok config-files" in (host.root / "var/lib/dpkg/status").read_text()
    assert host.run(["dpkg-query", "-W", "nvidia-driver-550-server"]).ok


# --- modules ----------------------------------------------------------------------------------------------


def test_rmmod_nvidia_fails_while_persistenced_holds_the_gpu(tmp_path: Path) -> None:
    host = make(tmp_path, "accel")
    assert host.run(["modprobe", "-r", "nvidia_uvm"]).ok
    busy = host.run(["rmmod", "nvidia"])
    assert (busy.returncode, busy.stderr) == (1, "rmmod: ERROR: Module nvidia is in use\n")
    assert host.run(["modprobe", "-r", "nvidia"]).stderr == "modprobe: FATAL: Module nvidia is in use.\n"
    assert host.run(["systemctl", "stop", "nvidia-persistenced"]).ok
    assert host.run(["rmmod", "nvidia"]).ok
    assert "nvidia" not in loaded(host)


def test_rmmod_names_dependent_modules(tmp_path: Path) -> None:
    host = make(tmp_path, "accel", services=False)
    result = host.run(["rmmod", "nvidia"])
    assert result.stderr == "rmmod: ERROR: Module nvidia is in use by: nvidia_uvm\n"


def test_modprobe_errors(tmp_path: Path) -> None:
    host = make(tmp_path, "none")
    missing = host.run(["modprobe", "nvidia"])
    assert missing.returncode == 1
    assert (
        missing.stderr
        == "modprobe: FATAL: Module nvidia not found in directory /lib/modules/6.8.0-45-generic\n"
    )
    assert host.run(["modprobe", "-q", "nvidia"]).stderr == ""
    assert (
        host.run(["modprobe", "-r", "vfio_pci"]).stderr
        == "modprobe: FATAL: Module vfio_pci is not in kernel.\n"
    )
    assert host.run(["modprobe", "vfio-pci"]).ok
    assert {"vfio_pci", "vfio_pci_core", "vfio"} <= set(loaded(host))
    assert host.run(["modprobe", "-r", "vfio_pci"]).ok  # and its now unused dependencies
    assert "vfio_pci_core" not in loaded(host)


def test_lsmod_prints_proc_modules(tmp_path: Path) -> None:
    host = make(tmp_path, "accel", services=False)
    lines = host.run(["lsmod"]).stdout.splitlines()
    assert lines[0] == "Module                  Size  Used by"
    nvidia = next(line for line in lines if line.startswith("nvidia "))
    assert nvidia.split()[2:] == ["1", "nvidia_uvm"]


# --- services ---------------------------------------------------------------------------------------------


def test_systemctl_unit_not_found(tmp_path: Path) -> None:
    host = make(tmp_path, "none")
    result = host.run(["systemctl", "start", "nvidia-persistenced"])
    assert (result.returncode, result.stderr) == (
        5,
        "Failed to start nvidia-persistenced.service: Unit nvidia-persistenced.service not found.\n",
    )


def test_service_fails_without_the_module_and_holds_gpus_when_running(tmp_path: Path) -> None:
    host = make(tmp_path, "accel", services=False)
    assert host.run(["modprobe", "-r", "nvidia_uvm"]).ok
    assert "nvidia" not in loaded(host)
    failed = host.run(["systemctl", "start", "nvidia-persistenced.service"])
    assert failed.returncode == 1 and "failed because the control process exited" in failed.stderr
    assert host.run(["modprobe", "nvidia"]).ok
    assert host.run(["systemctl", "start", "nvidia-persistenced"]).ok
    assert os.path.lexists(host.root / "run/systemd/units/invocation:nvidia-persistenced.service")
    assert [(h.holder, h.target) for h in EmulatedKernel(host.root).handles()] == [
        ("nvidia-persistenced.service", GPU)
    ]
    assert host.run(["systemctl", "is-active", "--quiet", "nvidia-persistenced"]).ok
    assert host.run(["systemctl", "is-enabled", "nvidia-persistenced"]).stdout == "enabled\n"


def test_vgpu_manager_needs_the_vgpu_build(tmp_path: Path) -> None:
    host = make(tmp_path, "accel", services=False)
    assert host.run(["modprobe", "-r", "nvidia_uvm"]).ok
    # pretend the package flavours were swapped without reloading: the unit exists, the loaded module is wrong
    assert host.run(["apt-get", "purge", "-y", "nvidia-driver-550-server"]).ok
    assert host.run(["apt-get", "install", "-y", "nvidia-vgpu-ubuntu-550"]).ok
    assert host.run(["modprobe", "nvidia"]).ok  # the vGPU build now
    assert host.run(["systemctl", "start", "nvidia-vgpu-mgr"]).ok


# --- NVIDIA tools -----------------------------------------------------------------------------------------


def test_sriov_manage_enables_and_disables_vfs(tmp_path: Path) -> None:
    host = make(tmp_path, "vgpu", services=False)
    dev = host.path("sys/bus/pci/devices", GPU)
    result = host.run(["/usr/lib/nvidia/sriov-manage", "-e", GPU])
    assert (result.returncode, result.stdout) == (0, f"Enabling VFs on {GPU}\n"), result.stderr
    assert (dev / "sriov_numvfs").read_text() == f"{L40S.sriov_total_vfs}\n"
    assert os.path.basename(os.readlink(dev / "driver")) == "nvidia"
    vf0 = (dev / "virtfn0").resolve()
    assert vf0.name == "0000:10:00.4" and (vf0 / "nvidia/current_vgpu_type").exists()
    again = host.run(["/usr/lib/nvidia/sriov-manage", "-e", "ALL"])
    assert again.stdout == f"GPU at {GPU} already has VFs enabled.\n"
    assert host.run(["/usr/lib/nvidia/sriov-manage", "-d", GPU]).ok
    assert (dev / "sriov_numvfs").read_text() == "0\n"
    assert os.path.basename(os.readlink(dev / "driver")) == "nvidia"


def test_sriov_manage_cannot_take_unbind_lock_while_gpu_is_held(tmp_path: Path) -> None:
    host = make(tmp_path, "vgpu")  # nvidia-vgpu-mgr holds the GPU
    result = host.run(["/usr/lib/nvidia/sriov-manage", "-e", GPU])
    assert (result.returncode, result.stderr) == (1, f"Cannot obtain unbindLock for {GPU}\n")
    assert host.path("sys/bus/pci/devices", GPU, "sriov_numvfs").read_text() == "0\n"


def test_sriov_manage_on_a_gpu_without_sriov_does_nothing(tmp_path: Path) -> None:
    host = create_host(mini_host("vgpu", T4, services=False), tmp_path / "t4")
    result = host.run(["/usr/lib/nvidia/sriov-manage", "-e", "ALL"])
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_nvidia_smi(tmp_path: Path) -> None:
    host = make(tmp_path, "accel", gpus=2, services=False)
    listing = host.run(["nvidia-smi", "-L"]).stdout.splitlines()
    assert [line.split(" (UUID")[0] for line in listing] == ["GPU 0: NVIDIA L40S", "GPU 1: NVIDIA L40S"]
    assert host.run(["nvidia-smi", "-pm", "1"]).stdout.endswith("All done.\n")
    assert "Virtualization Mode               : None" in host.run(["nvidia-smi", "-q"]).stdout
    assert host.run(["nvidia-smi", "vgpu"]).returncode == 6


def test_nvidia_smi_version_mismatch_after_swapping_packages(tmp_path: Path) -> None:
    host = make(tmp_path, "accel", services=False)
    assert host.run(["apt-get", "purge", "-y", "nvidia-driver-550-server"]).ok
    assert host.run(["apt-get", "install", "-y", "nvidia-vgpu-ubuntu-550"]).ok
    result = host.run(["nvidia-smi"])  # the data-center nvidia.ko is still loaded
    assert result.returncode == 18 and "Driver/library version mismatch" in result.stdout


def test_nvidia_ctk_configures_containerd(tmp_path: Path) -> None:
    host = create_host(mini_host("accel"), tmp_path / "h")
    assert host.run(["apt-get", "install", "-y", "nvidia-container-toolkit"]).ok
    result = host.run(["nvidia-ctk", "runtime", "configure", "--runtime=containerd"])
    assert result.ok and "Wrote updated config to /etc/containerd/config.toml" in result.stderr
    assert "nvidia-container-runtime" in (host.root / "etc/containerd/config.toml").read_text()
    assert host.run(["nvidia-ctk", "runtime", "configure", "--runtime=podman"]).returncode == 1


def test_driverctl_moves_a_gpu_to_vfio_and_back(tmp_path: Path) -> None:
    host = make(tmp_path, "accel", services=False)
    assert host.run(["modprobe", "-r", "nvidia_uvm", "nvidia"]).ok
    assert host.run(["driverctl", "set-override", GPU, "vfio-pci"]).ok
    assert os.path.basename(os.readlink(host.path("sys/bus/pci/devices", GPU, "driver"))) == "vfio-pci"
    assert host.run(["driverctl", "list-overrides"]).stdout == f"{GPU} vfio-pci\n"
    assert host.run(["driverctl", "unset-override", GPU]).ok
    assert host.path("sys/bus/pci/devices", GPU, "driver_override").read_text() == "(null)\n"
    assert host.run(["driverctl", "list-overrides"]).stdout == ""


def test_update_initramfs(tmp_path: Path) -> None:
    host = make(tmp_path, "none")
    result = host.run(["update-initramfs", "-u"])
    assert result.stdout == "update-initramfs: Generating /boot/initrd.img-6.8.0-45-generic\n"
    assert host.run(["update-initramfs"]).returncode == 1
