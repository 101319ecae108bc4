"""A hand-built, kernel-shaped sysfs tree for discovery tests, and an lspci output parser.

The builder follows the kernel ABI (reference doc §1–§6): real device directories nested under
``sys/devices/pci<DDDD>:<BB>/``, relative symlinks for ``sys/bus/pci/devices/<BDF>``, ``driver``,
``iommu_group``, ``physfn``/``virtfnN``, ``mdev_type`` and ``consumer:pci:`` (to the devlink device, as the
kernel does), attribute files in the kernel's formats, and a 64-byte ``config`` so that lspci itself can read
the tree. The tests in this file check the builder against lspci, so the other discovery tests build on a tree
lspci agrees with.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpumode.domain import PciAddress


class SysTree:
    """Builds ``sys``, ``proc``, ``etc``, ``var`` and ``run`` under ``root`` as kernel and distro do."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sys = root / "sys"
        self.dirs: dict[str, Path] = {}
        for rel in ("bus/pci/devices", "bus/pci/drivers", "kernel/iommu_groups", "module"):
            (self.sys / rel).mkdir(parents=True, exist_ok=True)

    # --- plumbing ----------------------------------------------------------------------------------------
    def write(self, rel: str, text: str | bytes) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return path

    @staticmethod
    def link(link: Path, target: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(target, link.parent), link)

    # --- PCI functions -------------------------------------------------------------------------------------
    def function(
        self,
        address: str,
        vendor: int,
        device: int,
        class_code: int,
        *,
        subsystem: tuple[int, int] = (0, 0),
        revision: int = 0xA1,
        numa: int = -1,
        group: int | None = None,
        driver: str | None = None,
        override: str | None = None,
        parent: str | None = None,
    ) -> Path:
        addr = PciAddress.parse(address)
        base = self.dirs[parent] if parent else self.sys / "devices" / f"pci{addr.domain:04x}:{addr.bus:02x}"
        d = base / address
        d.mkdir(parents=True)
        self.dirs[address] = d
        attrs = {
            "vendor": f"0x{vendor:04x}",
            "device": f"0x{device:04x}",
            "subsystem_vendor": f"0x{subsystem[0]:04x}",
            "subsystem_device": f"0x{subsystem[1]:04x}",
            "class": f"0x{class_code:06x}",
            "revision": f"0x{revision:02x}",
            "numa_node": str(numa),
            "driver_override": override or "(null)",
            "enable": "1",
        }
        for name, value in attrs.items():
            (d / name).write_text(value + "\n")
        config = struct.pack("<HHHHBBBB", vendor, device, 0x0406, 0x0010, revision, *_class_bytes(class_code))
        config += bytes(0x2C - len(config)) + struct.pack("<HH", *subsystem) + bytes(64 - 0x30)
        (d / "config").write_bytes(config)
        self.link(self.sys / "bus/pci/devices" / address, d)
        self.link(d / "subsystem", self.sys / "bus/pci")
        if group is not None:
            gdir = self.sys / "kernel/iommu_groups" / str(group)
            self.link(gdir / "devices" / address, d)
            self.link(d / "iommu_group", gdir)
        if driver:
            self.bind(address, driver)
        return d

    def bind(self, address: str, driver: str) -> None:
        d = self.dirs[address]
        ddir = self.sys / "bus/pci/drivers" / driver
        for attr in ("bind", "unbind", "new_id", "remove_id"):
            self.write(str((ddir / attr).relative_to(self.root)), "")
        self.link(ddir / address, d)
        self.link(d / "driver", ddir)

    def sriov(
        self,
        pf: str,
        total: int,
        vfs: list[str],
        *,
        vf_device: int | None = None,
        vf_driver: str | None = None,
        first_group: int | None = None,
        offset: int | None = 4,  # None: no sriov_offset / sriov_stride files
        stride: int = 1,
    ) -> None:
        d = self.dirs[pf]
        (d / "sriov_totalvfs").write_text(f"{total}\n")
        (d / "sriov_numvfs").write_text(f"{len(vfs)}\n")
        if offset is not None:
            (d / "sriov_offset").write_text(f"{offset}\n")
            (d / "sriov_stride").write_text(f"{stride}\n")
        vendor = int((d / "vendor").read_text(), 16)
        device = vf_device if vf_device is not None else int((d / "device").read_text(), 16)
        class_code = int((d / "class").read_text(), 16)
        numa = int((d / "numa_node").read_text())
        parent = d.parent
        for n, vf in enumerate(vfs):
            group = None if first_group is None else first_group + n
            self.dirs[vf] = parent / vf
            vf_dir = self.function(
                vf,
                vendor,
                device,
                class_code,
                numa=numa,
                group=group,
                driver=vf_driver,
                parent=next((a for a, p in self.dirs.items() if p == parent), None),
            )
            self.link(vf_dir / "physfn", d)
            self.link(d / f"virtfn{n}", vf_dir)

    def mdev_type(
        self,
        address: str,
        type_id: str,
        name: str,
        available: int,
        description: str = "num_heads=4, frl_config=60, framebuffer=2048M, max_resolution=5120x2880, "
        "max_instance=8",
    ) -> None:
        t = self.dirs[address] / "mdev_supported_types" / type_id
        (t / "devices").mkdir(parents=True)
        for attr, value in (
            ("name", name),
            ("description", description),
            ("device_api", "vfio-pci"),
            ("available_instances", str(available)),
            ("create", ""),
        ):
            (t / attr).write_text(value + "\n" if value else "")

    def mdev(self, address: str, uuid: str, type_id: str) -> None:
        d = self.dirs[address]
        m = d / uuid
        m.mkdir()
        (m / "remove").write_text("")
        t = d / "mdev_supported_types" / type_id
        self.link(m / "mdev_type", t)
        self.link(t / "devices" / uuid, m)
        self.link(self.sys / "bus/mdev/devices" / uuid, m)

    def vendor_vgpu(self, vf: str, creatable: dict[int, str], current: int = 0) -> None:
        n = self.dirs[vf] / "nvidia"
        n.mkdir()
        # nvidia-vgpu-vfio: header "ID    : vGPU Name\n", then "%-5d : %s" per type (names end in "\n")
        (n / "creatable_vgpu_types").write_text(
            "ID    : vGPU Name\n" + "".join(f"{i:<5d} : {name}\n" for i, name in creatable.items())
        )
        (n / "current_vgpu_type").write_text(f"{current}\n")

    def consumer(self, supplier: str, consumer: str) -> None:
        devlink = self.sys / "devices/virtual/devlink" / f"pci:{supplier}--pci:{consumer}"
        devlink.mkdir(parents=True)
        self.link(self.dirs[supplier] / f"consumer:pci:{consumer}", devlink)
        self.link(self.dirs[consumer] / f"supplier:pci:{supplier}", devlink)

    # --- the rest of the host ------------------------------------------------------------------------------
    def host(self, hostname: str = "gpu-node-1", kernel: str = "6.8.0-45-generic") -> None:
        self.write("proc/sys/kernel/hostname", hostname + "\n")
        self.write("proc/sys/kernel/osrelease", kernel + "\n")

    def modules(self, *names: str) -> None:
        """``proc/modules`` and ``sys/module/<name>`` for each module; NVIDIA ones get the (POE) taint."""
        lines = []
        for name in names:
            taint = " (POE)" if name.startswith("nvidia") else ""
            lines.append(f"{name} 16384 0 - Live 0x0000000000000000{taint}")
            self.write(f"sys/module/{name}/initstate", "live\n")
        self.write("proc/modules", "\n".join(lines) + "\n")

    def nvidia_version(self, version: str, *, open_build: bool = False) -> None:
        kind = "Open Kernel Module for x86_64" if open_build else "x86_64 Kernel Module"
        self.write(
            "proc/driver/nvidia/version",
            f"NVRM version: NVIDIA UNIX {kind}  {version}  Release Build  (dvs-builder@U16)  Mon Jan 1 2024\n"
            "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n",
        )
        self.write("sys/module/nvidia/version", version + "\n")

    def packages(self, *packages: tuple[str, str]) -> None:
        stanzas = [
            f"Package: {name}\nStatus: install ok installed\nArchitecture: amd64\nVersion: {version}\n"
            f"Description: {name}\n a long description\n"
            for name, version in packages
        ]
        self.write("var/lib/dpkg/status", "\n".join(stanzas))

    def services(self, *units: str) -> None:
        (self.root / "run/systemd/units").mkdir(parents=True, exist_ok=True)
        for unit in units:
            os.symlink("6f1e2d3c4b5a69788796a5b4c3d2e1f0", self.root / f"run/systemd/units/invocation:{unit}")


def _class_bytes(class_code: int) -> tuple[int, int, int]:
    return class_code & 0xFF, (class_code >> 8) & 0xFF, (class_code >> 16) & 0xFF


# --- lspci -------------------------------------------------------------------------------------------


@dataclass
class LspciEntry:
    address: str
    class_id: int  # base class and subclass, as lspci -nn prints them: [0302]
    vendor: int
    device: int
    revision: int  # lspci omits "(rev 00)"
    driver: str | None


# "0000:18:00.0 3D controller [0302]: NVIDIA Corporation GH100 [H100 SXM5 80GB] [10de:2330] (rev a1)"
_LSPCI_LINE = re.compile(
    r"^(?P<addr>[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]) .*?\[(?P<cls>[0-9a-f]{4})\]: "
    r".*\[(?P<ven>[0-9a-f]{4}):(?P<dev>[0-9a-f]{4})\]"
    r"(?: \(rev (?P<rev>[0-9a-f]{2})\))?(?: \(prog-if [^)]*\))?$"
)


def parse_lspci(text: str) -> dict[str, LspciEntry]:
    """Parse ``lspci -D -nn -k`` output: one entry per function, with "Kernel driver in use"."""
    entries: dict[str, LspciEntry] = {}
    current: LspciEntry | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            key, _, value = line.strip().partition(":")
            if current is not None and key == "Kernel driver in use":
                current.driver = value.strip()
            continue
        m = _LSPCI_LINE.match(line)
        assert m, f"unparsed lspci line: {line!r}"
        current = LspciEntry(
            m["addr"], int(m["cls"], 16), int(m["ven"], 16), int(m["dev"], 16), int(m["rev"] or "0", 16), None
        )
        entries[current.address] = current
    return entries


def lspci(*args: str) -> str:
    return subprocess.run(["lspci", *args], capture_output=True, text=True, check=True).stdout


needs_lspci = pytest.mark.skipif(shutil.which("lspci") is None, reason="lspci (pciutils) is not installed")


# --- tests of the builder and the parser -------------------------------------------------------------------


def test_parse_lspci_handles_brackets_in_names_and_revisions() -> None:
    text = (
        "0000:18:00.0 3D controller [0302]: NVIDIA Corporation GH100 [H100 SXM5 80GB] [10de:2330] (rev a1)\n"
        "\tSubsystem: NVIDIA Corporation Device [10de:16c1]\n"
        "\tKernel driver in use: nvidia\n"
        "\tKernel modules: nvidiafb, nouveau, nvidia_drm, nvidia\n"
        "0000:00:00.0 Host bridge [0600]: Intel Corporation Device [8086:0d57]\n"
        "0000:00:01.0 Unassigned class [ffff]: Red Hat, Inc. Virtio 1.0 memory balloon [1af4:1045] (rev 01)\n"
    )
    entries = parse_lspci(text)
    assert entries["0000:18:00.0"] == LspciEntry("0000:18:00.0", 0x0302, 0x10DE, 0x2330, 0xA1, "nvidia")
    assert entries["0000:00:00.0"] == LspciEntry("0000:00:00.0", 0x0600, 0x8086, 0x0D57, 0, None)
    assert entries["0000:00:01.0"].class_id == 0xFFFF


@needs_lspci
def test_lspci_reads_the_hand_built_tree(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    tree.function("0000:00:01.0", 0x8086, 0x1BB8, 0x060400, group=1, driver="pcieport")
    tree.function(
        "0000:18:00.0",
        0x10DE,
        0x2330,
        0x030200,
        subsystem=(0x10DE, 0x16C1),
        group=2,
        driver="nvidia",
        parent="0000:00:01.0",
    )
    tree.function("0000:65:00.0", 0x10DE, 0x2230, 0x030000, revision=0, group=3, driver="vfio-pci")
    out = lspci("-D", "-nn", "-k", "-A", "linux-sysfs", "-O", f"sysfs.path={tmp_path}/sys/bus/pci")
    entries = parse_lspci(out)
    assert set(entries) == {"0000:00:01.0", "0000:18:00.0", "0000:65:00.0"}
    assert entries["0000:18:00.0"] == LspciEntry("0000:18:00.0", 0x0302, 0x10DE, 0x2330, 0xA1, "nvidia")
    assert entries["0000:65:00.0"].driver == "vfio-pci"
    assert entries["0000:65:00.0"].revision == 0
