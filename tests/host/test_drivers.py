"""Driver state: /proc/modules, the NVRM version, dpkg status, systemd units, flavour and host state rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumode.domain import DriverState, Flavour, Mode, NvidiaDriver, Package
from gpumode.host.drivers import (
    SERVICES,
    FlavourEvidence,
    classify_package,
    decide_flavour,
    driver_packages,
    gpu_mode,
    host_driver_state,
    parse_dpkg_status,
    parse_nvrm_version,
    parse_proc_modules,
    read_driver_facts,
)
from gpumode.host.root import Host

PROC_MODULES = """\
nvidia_uvm 1789952 0 - Live 0x0000000000000000 (POE)
nvidia_drm 122880 0 - Live 0x0000000000000000 (POE)
nvidia_modeset 1355776 1 nvidia_drm, Live 0x0000000000000000 (POE)
nvidia 54288384 2 nvidia_uvm,nvidia_modeset, Live 0x0000000000000000 (POE)
vfio_pci 16384 0 - Live 0xffffffffc0a51000
ipv6 602112 28 [permanent], Live 0x0000000000000000
"""

NVRM_PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
)
NVRM_OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  555.42.06  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Tue Jun  4 01:08:49 UTC 2024\n"
    "GCC version:  gcc version 12.3.0\n"
)

DPKG_STATUS = """\
Package: nvidia-driver-550-server
Status: install ok installed
Priority: optional
Version: 550.127.05-0ubuntu0.22.04.1
Description: NVIDIA Server Driver metapackage
 This metapackage depends on the NVIDIA binary server driver
 .
 Package: not-a-real-field-because-it-is-a-continuation

Package: nvidia-fabricmanager-550
Status: install ok installed
Version: 550.127.05-1

Package: nvidia-container-toolkit
Status: install ok installed
Version: 1.17.3-1

Package: nvidia-vgpu-ubuntu-550
Status: deinstall ok config-files
Version: 550.127.06

Package: libnvidia-compute-550-server
Status: install ok installed
Version: 550.127.05-0ubuntu0.22.04.1

Package: bash
Status: install ok installed
Version: 5.1-6ubuntu1
"""


def test_proc_modules_lines() -> None:
    modules, problems = parse_proc_modules(PROC_MODULES)
    assert problems == []
    by_name = {m.name: m for m in modules}
    assert [m.name for m in modules] == sorted(by_name)  # canonical order, not load order
    nvidia = by_name["nvidia"]
    assert (nvidia.size, nvidia.refcount, nvidia.users, nvidia.state) == (
        54288384,
        2,
        ["nvidia_uvm", "nvidia_modeset"],
        "Live",
    )
    assert by_name["nvidia_uvm"].users == []
    assert by_name["ipv6"].users == []  # [permanent] is a flag, not a user
    assert by_name["vfio_pci"].refcount == 0


def test_proc_modules_without_module_unload_and_garbage() -> None:
    modules, problems = parse_proc_modules("vfio 45056 - - Live 0x0\nthis is not a module line\n\n")
    assert [(m.name, m.refcount, m.users) for m in modules] == [("vfio", -1, [])]
    assert problems == ["proc/modules:2: unreadable line 'this is not a module line'"]


def test_nvrm_version_proprietary_and_open() -> None:
    assert parse_nvrm_version(NVRM_PROPRIETARY) == ("535.129.03", False)
    assert parse_nvrm_version(NVRM_OPEN) == ("555.42.06", True)
    assert parse_nvrm_version("garbage") == (None, None)


def test_dpkg_status_installed_only() -> None:
    installed = dict(parse_dpkg_status(DPKG_STATUS))
    assert installed["nvidia-driver-550-server"] == "550.127.05-0ubuntu0.22.04.1"
    assert "nvidia-vgpu-ubuntu-550" not in installed  # only its config files remain
    assert "not-a-real-field-because-it-is-a-continuation" not in installed
    assert "bash" in installed


@pytest.mark.parametrize(
    ("name", "flavour"),
    [
        ("nvidia-driver-550-server", Flavour.DATACENTER),
        ("nvidia-driver-550-server-open", Flavour.DATACENTER),
        ("nvidia-driver-535", Flavour.DATACENTER),
        ("nvidia-fabricmanager-550", Flavour.DATACENTER),
        ("nvidia-container-toolkit", None),  # runs beside either build: not a driver package
        ("nvidia-container-toolkit-base", None),
        ("libnvidia-container1", None),
        ("datacenter-gpu-manager", None),
        ("linux-modules-nvidia-550-server-open-6.8.0-45-generic", Flavour.DATACENTER),
        ("nvidia-vgpu-ubuntu-550", Flavour.VGPU),
        ("nvidia-vgpu-ubuntu-535", Flavour.VGPU),
        ("nvidia-settings", None),
        ("libnvidia-compute-550-server", None),
        ("bash", None),
    ],
)
def test_package_classification(name: str, flavour: Flavour | None) -> None:
    assert classify_package(name) is flavour


def test_driver_packages_keep_nvidia_ones_only() -> None:
    packages = driver_packages(parse_dpkg_status(DPKG_STATUS))
    assert [(p.name, p.flavour) for p in packages] == [
        ("libnvidia-compute-550-server", None),
        ("nvidia-container-toolkit", None),
        ("nvidia-driver-550-server", Flavour.DATACENTER),
        ("nvidia-fabricmanager-550", Flavour.DATACENTER),
    ]


def _nv(loaded: bool, vfio: bool, *flavours: Flavour) -> NvidiaDriver:
    packages = [Package(f"pkg-{i}", "1", f) for i, f in enumerate(flavours)]
    return NvidiaDriver(loaded=loaded, vgpu_vfio_loaded=vfio, packages=packages)


def _ev(vgpu: tuple[str, ...] = (), dc: tuple[str, ...] = (), listed: str | None = "proc/modules"):  # type: ignore[no-untyped-def]
    return FlavourEvidence(list(vgpu), list(dc), listed)


def test_flavour_rules() -> None:
    vgpu_trace = ("proc/modules: nvidia_vgpu_vfio loaded",)
    assert decide_flavour(_nv(True, True), _ev(vgpu_trace)) is Flavour.VGPU
    assert decide_flavour(_nv(True, False), _ev(("sys/bus/mdev/drivers/nvidia-vgpu-vfio",))) is Flavour.VGPU
    # a complete module list without the vGPU manager: the data-center build
    assert decide_flavour(_nv(True, False), _ev()) is Flavour.DATACENTER
    assert decide_flavour(_nv(True, False), _ev(dc=("proc/modules: nvidia_uvm",), listed=None)) is (
        Flavour.DATACENTER
    )
    # installed packages say nothing while nvidia is loaded; they say what would load when it is not
    assert decide_flavour(_nv(False, False, Flavour.VGPU), _ev()) is Flavour.VGPU
    assert decide_flavour(_nv(False, False), _ev()) is None
    problems: list[str] = []
    assert decide_flavour(_nv(False, False, Flavour.VGPU, Flavour.DATACENTER), _ev(), problems) is None
    assert len(problems) == 1 and "both" in problems[0]


def test_no_evidence_is_no_default() -> None:
    problems: list[str] = []
    assert decide_flavour(_nv(True, False, Flavour.DATACENTER), _ev(listed=None), problems) is None
    assert len(problems) == 1 and "nvidia build unknown" in problems[0] and "no module list" in problems[0]


def test_conflicting_evidence_is_a_problem_not_a_guess() -> None:
    problems: list[str] = []
    both = _ev(
        ("sys/bus/mdev/drivers/nvidia-vgpu-vfio: 3 mdev(s) bound",), ("proc/modules: nvidia_uvm loaded",)
    )
    assert decide_flavour(_nv(True, False), both, problems) is None
    assert (
        "both the vGPU manager" in problems[0] and "nvidia_uvm" in problems[0] and "3 mdev(s)" in problems[0]
    )


def test_gpu_mode_rules() -> None:
    assert gpu_mode("nvidia", None) is Mode.UNKNOWN
    assert gpu_mode("nvidia", Flavour.DATACENTER) is Mode.ACCEL
    assert gpu_mode("nvidia", Flavour.VGPU) is Mode.VGPU
    assert gpu_mode("vfio-pci", None) is Mode.PASSTHROUGH
    assert gpu_mode("nvgrace_gpu_vfio_pci", Flavour.VGPU) is Mode.PASSTHROUGH
    assert gpu_mode("nouveau", Flavour.DATACENTER) is Mode.NONE
    assert gpu_mode(None, Flavour.DATACENTER) is Mode.NONE


@pytest.mark.parametrize(
    ("modes", "state"),
    [
        ([], DriverState.NONE),
        ([Mode.ACCEL, Mode.ACCEL], DriverState.DATACENTER),
        ([Mode.VGPU], DriverState.VGPU_HOST),
        ([Mode.PASSTHROUGH] * 3, DriverState.VFIO),
        ([Mode.NONE, Mode.NONE], DriverState.NONE),
        ([Mode.ACCEL, Mode.PASSTHROUGH], DriverState.MIXED),
        ([Mode.VGPU, Mode.NONE], DriverState.MIXED),
        ([Mode.UNKNOWN, Mode.ACCEL], DriverState.UNKNOWN),
    ],
)
def test_host_driver_state(modes: list[Mode], state: DriverState) -> None:
    assert host_driver_state(modes) is state


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_read_driver_facts_of_a_data_center_host(tmp_path: Path) -> None:
    _write(tmp_path, "proc/modules", PROC_MODULES)
    _write(tmp_path, "proc/driver/nvidia/version", NVRM_PROPRIETARY)
    _write(tmp_path, "sys/module/nvidia/version", "535.129.03\n")
    _write(tmp_path, "var/lib/dpkg/status", DPKG_STATUS)
    _write(tmp_path, "run/systemd/units/invocation:nvidia-persistenced.service", "")
    (tmp_path / "run/systemd/units/invocation:nvidia-fabricmanager.service").symlink_to(
        "abc123"
    )  # as systemd
    facts = read_driver_facts(Host(tmp_path))
    assert facts.problems == []
    nv = facts.nvidia
    assert (nv.loaded, nv.flavour, nv.version, nv.open_kernel_module, nv.vgpu_vfio_loaded) == (
        True,
        Flavour.DATACENTER,
        "535.129.03",
        False,
        False,
    )
    assert nv.services == {
        "nvidia-persistenced.service": True,
        "nvidia-fabricmanager.service": True,
        "nvidia-vgpud.service": False,
        "nvidia-vgpu-mgr.service": False,
    }
    assert set(nv.services) == set(SERVICES)
    assert {m.name for m in facts.modules} >= {"nvidia", "nvidia_uvm"}


def test_read_driver_facts_of_a_vgpu_host_from_sysfs_only(tmp_path: Path) -> None:
    # No procfs at all: modules come from sys/module/*/initstate, the version from sys/module/nvidia/version,
    # open-or-not from its taint. Built-in code (no initstate) is not taken for a loaded module.
    for name in ("nvidia", "nvidia_vgpu_vfio", "vfio"):
        _write(tmp_path, f"sys/module/{name}/initstate", "live\n")
    _write(tmp_path, "sys/module/pcieport/parameters/x", "1\n")
    _write(tmp_path, "sys/module/nvidia/version", "550.127.06\n")
    _write(tmp_path, "sys/module/nvidia/taint", "OE\n")
    (tmp_path / "run/systemd/units").mkdir(parents=True)
    facts = read_driver_facts(Host(tmp_path))
    nv = facts.nvidia
    assert (nv.loaded, nv.vgpu_vfio_loaded, nv.flavour, nv.version, nv.open_kernel_module) == (
        True,
        True,
        Flavour.VGPU,
        "550.127.06",
        True,
    )
    assert facts.modules == []
    assert facts.problems == ["proc/modules: missing; loaded modules taken from sys/module/*/initstate"]
    assert not any(nv.services.values())


def test_version_disagreement_and_missing_systemd_are_reported(tmp_path: Path) -> None:
    _write(tmp_path, "proc/modules", "nvidia 1 0 - Live 0x0 (POE)\n")
    _write(tmp_path, "proc/driver/nvidia/version", NVRM_PROPRIETARY)
    _write(tmp_path, "sys/module/nvidia/version", "550.1.2\n")
    facts = read_driver_facts(Host(tmp_path))
    assert facts.nvidia.version == "535.129.03"  # procfs wins
    assert any("550.1.2" in p and "535.129.03" in p for p in facts.problems)
    assert any(p.startswith("run/systemd/units: missing") for p in facts.problems)
    assert facts.nvidia.services == {}


def test_nothing_nvidia_at_all(tmp_path: Path) -> None:
    _write(tmp_path, "proc/modules", "ext4 1 2 - Live 0x0\n")
    (tmp_path / "run/systemd/units").mkdir(parents=True)
    facts = read_driver_facts(Host(tmp_path))
    assert facts.problems == []
    assert facts.nvidia == NvidiaDriver(services=dict.fromkeys(SERVICES, False))


# The vGPU-KVM host's NVRM line in the proprietary format (NOT VERIFIED beyond that): only the version.
NVRM_VGPU_HOST = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.127.06  Tue Nov 12 21:38:03 UTC 2024\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~24.04)\n"
)


def test_nvrm_version_of_each_flavour() -> None:
    assert parse_nvrm_version(NVRM_VGPU_HOST) == ("550.127.06", False)
    assert parse_nvrm_version(NVRM_PROPRIETARY) == ("535.129.03", False)
    assert parse_nvrm_version(NVRM_OPEN) == ("555.42.06", True)


def test_a_vgpu_host_without_sys_module_is_told_by_its_mdev_driver(tmp_path: Path) -> None:
    # proc/modules unreadable, sys/module absent: the mdevs bound to nvidia-vgpu-vfio still say vGPU manager
    _write(tmp_path, "proc/driver/nvidia/version", NVRM_VGPU_HOST)
    drv = tmp_path / "sys/bus/mdev/drivers/nvidia-vgpu-vfio"
    drv.mkdir(parents=True)
    for uuid in ("a", "b", "c"):
        (drv / uuid).symlink_to(f"../../../../devices/x/{uuid}")
    (tmp_path / "run/systemd/units").mkdir(parents=True)
    facts = read_driver_facts(Host(tmp_path))
    assert facts.nvidia.loaded and facts.nvidia.flavour is Flavour.VGPU
    assert facts.evidence.vgpu == ["sys/bus/mdev/drivers/nvidia-vgpu-vfio: 3 mdev(s) bound"]


def test_container_toolkit_beside_the_vgpu_manager_is_no_conflict(tmp_path: Path) -> None:
    _write(
        tmp_path, "proc/modules", "nvidia_vgpu_vfio 1 0 - Live 0x0\nnvidia 1 1 nvidia_vgpu_vfio, Live 0x0\n"
    )
    _write(
        tmp_path,
        "var/lib/dpkg/status",
        "Package: nvidia-vgpu-ubuntu-550\nStatus: install ok installed\nVersion: 550.127.06\n\n"
        "Package: nvidia-container-toolkit\nStatus: install ok installed\nVersion: 1.16.2-1\n",
    )
    (tmp_path / "run/systemd/units").mkdir(parents=True)
    facts = read_driver_facts(Host(tmp_path))
    assert facts.nvidia.flavour is Flavour.VGPU and facts.problems == []
