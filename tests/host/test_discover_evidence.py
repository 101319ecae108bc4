"""Discovery tells the nvidia build from every piece of evidence, and drops functions that vanish mid-read."""

from __future__ import annotations

import shutil
from pathlib import Path

from gpumode.domain import DriverState, Flavour, Mode
from gpumode.emulated.create import create_host
from gpumode.host.discover import SysReader, discover
from gpumode.host.root import Host
from host_templates import HostTemplates


def _copy(templates: HostTemplates, name: str, where: Path) -> Path:
    return templates.copy(name, lambda r: create_host(name, r), where / name)


def test_live_vgpus_say_vgpu_host_without_sys_module(host_templates: HostTemplates, tmp_path: Path) -> None:
    root = _copy(host_templates, "a16-vdi", tmp_path)
    shutil.rmtree(root / "sys/module")
    (root / "proc/modules").unlink()  # a sandboxed view: no module list at all
    snap = discover(root)
    assert snap.nvidia.flavour is Flavour.VGPU and snap.driver_state is DriverState.VGPU_HOST
    assert all(g.mode is Mode.VGPU for g in snap.gpus)


def test_conflicting_evidence_is_unknown_with_a_problem(
    host_templates: HostTemplates, tmp_path: Path
) -> None:
    root = _copy(host_templates, "a16-vdi", tmp_path)
    modules = root / "proc/modules"
    listed = modules.read_text()
    modules.unlink()  # a hard link into the session's template: this copy gets a file of its own
    # the data-center build's nvidia_uvm beside live mdevs
    modules.write_text(listed + "nvidia_uvm 1789952 0 - Live 0x0000000000000000 (POE)\n")
    snap = discover(root)
    assert snap.nvidia.flavour is None and snap.driver_state is DriverState.UNKNOWN
    assert all(g.mode is Mode.UNKNOWN for g in snap.gpus)
    (problem,) = [p for p in snap.problems if "nvidia build unknown" in p]
    assert "nvidia-vgpu-vfio" in problem and "nvidia_uvm" in problem


def test_the_r580_host_is_a_vgpu_host_with_the_vendor_interface(host_templates: HostTemplates) -> None:
    root = host_templates.template("a2-r580", lambda r: create_host("a2-r580", r))
    snap = discover(root)
    assert snap.problems == [] and snap.driver_state is DriverState.VGPU_HOST
    assert snap.nvidia.version == "580.65.05" and snap.kernel == "6.8.0-60-generic"
    assert len(snap.gpus[0].vgpus) == 3 and not any(f.mdev_types for f in snap.functions)


class _Vanishing(SysReader):
    """Removes a function's directory right after discovery listed the PCI devices (a hot-remove)."""

    def __init__(self, victim: Path) -> None:
        self.victim = victim

    def listdir(self, path: str) -> list[str]:
        names = super().listdir(path)
        if path.endswith("sys/bus/pci/devices") and self.victim.exists():
            target = self.victim.resolve()
            self.victim.unlink()
            shutil.rmtree(target)
        return names


def test_a_function_that_vanishes_mid_read_is_dropped_and_reported(
    host_templates: HostTemplates, tmp_path: Path
) -> None:
    root = _copy(host_templates, "rtx-workstation", tmp_path)
    usb = "0000:01:00.2"
    snap = discover(root, reader=_Vanishing(root / "sys/bus/pci/devices" / usb))
    assert snap.function(usb) is None
    assert f"sys/bus/pci/devices/{usb}: vanished while being read (hot-removed?); dropped" in snap.problems
    assert not any(f.vendor < 0 for f in snap.functions)
    assert not any(p.startswith(f"sys/bus/pci/devices/{usb}/") for p in snap.problems)


def test_boot_vga_is_read(host_templates: HostTemplates, tmp_path: Path) -> None:
    root = _copy(host_templates, "rtx-workstation", tmp_path)
    gpu = "0000:01:00.0"
    assert discover(root).function(gpu).boot_vga is False  # type: ignore[union-attr]
    attr = root / "sys/bus/pci/devices" / gpu / "boot_vga"
    attr.unlink()
    attr.write_text("1\n")  # the firmware put its console on this GPU
    snap = discover(root)
    assert snap.function(gpu).boot_vga is True  # type: ignore[union-attr]
    assert snap.function("0000:01:00.1").boot_vga is None  # type: ignore[union-attr]  # audio: no such file


def test_a_partial_gpu_group_is_reported_and_refused(host_templates: HostTemplates, tmp_path: Path) -> None:
    from gpumode.domain import SwitchRequest
    from gpumode.modes import engine
    from gpumode.modes.policy import RequestError

    root = _copy(host_templates, "rtx-workstation", tmp_path)
    ucsi = "0000:01:00.3"
    (root / "sys/bus/pci/devices" / ucsi).unlink()  # the group still holds it; the bus no longer lists it
    snap = discover(root)
    partial = [p for p in snap.problems if "partial group" in p]
    assert partial and ucsi in partial[0] and partial[0].startswith("sys/bus/pci/devices/0000:01:00.0/")
    try:
        engine.plan(Host(root), SwitchRequest(Mode.ACCEL), snapshot=snap)
    except RequestError as exc:
        assert exc.code == "inconsistent_hardware" and ucsi in exc.message
    else:
        raise AssertionError("a partial group was planned")
