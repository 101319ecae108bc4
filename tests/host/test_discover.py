"""Discovery on hand-built kernel-shaped trees: data-center, mdev vGPU, vendor vGPU (SR-IOV), passthrough,
mixed, and everything that can be odd about a tree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_discover_tree import SysTree

from gpumode.domain import DriverState, Flavour, HostSnapshot, Mode
from gpumode.host.discover import SysReader, discover
from gpumode.host.root import Host

NV = 0x10DE
H100, NVSWITCH, T4, L40S, A6000, A6000_HDA = 0x2330, 0x22A3, 0x1EB8, 0x26B9, 0x2230, 0x1AEF
UUID_A = "4b3c1a0e-5f6d-4e7a-8b9c-0d1e2f3a4b5c"
UUID_B = "9a8b7c6d-5e4f-4a3b-9c1d-0e1f2a3b4c5d"


def datacenter_host(root: Path) -> SysTree:
    """Two H100s and an NVSwitch on the data-center driver, a bridge, a NIC."""
    t = SysTree(root)
    t.host("hgx-1")
    t.function("0000:00:01.0", 0x8086, 0x1BB8, 0x060400, group=1, driver="pcieport")
    t.function(
        "0000:18:00.0",
        NV,
        H100,
        0x030200,
        subsystem=(NV, 0x16C1),
        numa=0,
        group=20,
        driver="nvidia",
        parent="0000:00:01.0",
    )
    t.function("0000:2a:00.0", NV, H100, 0x030200, subsystem=(NV, 0x16C1), numa=1, group=21, driver="nvidia")
    t.function("0000:05:00.0", NV, NVSWITCH, 0x068000, group=30, driver="nvidia")
    t.function("0000:3b:00.0", 0x15B3, 0x1021, 0x020000, numa=0, group=40, driver="mlx5_core")
    t.modules("nvidia", "nvidia_uvm", "nvidia_modeset", "mlx5_core")
    t.nvidia_version("550.127.05")
    t.packages(
        ("nvidia-driver-550-server", "550.127.05-0ubuntu1"),
        ("nvidia-fabricmanager-550", "550.127.05-1"),
        ("nvidia-container-toolkit", "1.17.3-1"),
        ("bash", "5.1"),
    )
    t.services("nvidia-persistenced.service", "nvidia-fabricmanager.service")
    return t


def test_datacenter_host(tmp_path: Path) -> None:
    datacenter_host(tmp_path)
    snap = discover(tmp_path)
    assert snap.problems == []
    assert (snap.hostname, snap.kernel) == ("hgx-1", "6.8.0-45-generic")
    assert [f.address for f in snap.functions] == [
        "0000:00:01.0",
        "0000:05:00.0",
        "0000:18:00.0",
        "0000:2a:00.0",
        "0000:3b:00.0",
    ]
    gpu = snap.function("0000:18:00.0")
    assert gpu is not None
    assert (gpu.vendor, gpu.device, gpu.subsystem_vendor, gpu.subsystem_device) == (NV, H100, NV, 0x16C1)
    assert (gpu.class_code, gpu.revision, gpu.numa_node, gpu.iommu_group, gpu.driver) == (
        0x030200,
        0xA1,
        0,
        20,
        "nvidia",
    )
    assert (gpu.vendor_name, gpu.device_name, gpu.class_name) == (
        "NVIDIA Corporation",
        "GH100 [H100 SXM5 80GB]",
        "3D controller",
    )
    assert gpu.driver_override is None and gpu.sriov is None and not gpu.is_vf
    assert [g.address for g in snap.gpus] == ["0000:18:00.0", "0000:2a:00.0"]
    assert all(g.mode is Mode.ACCEL and g.companions == [] for g in snap.gpus)
    assert snap.gpus[0].name == "GH100 [H100 SXM5 80GB]" and snap.gpus[1].numa_node == 1
    assert snap.nvswitches == ["0000:05:00.0"]
    assert snap.driver_state is DriverState.DATACENTER
    nv = snap.nvidia
    assert (nv.loaded, nv.flavour, nv.version, nv.open_kernel_module, nv.vgpu_vfio_loaded) == (
        True,
        Flavour.DATACENTER,
        "550.127.05",
        False,
        False,
    )
    assert [p.name for p in nv.packages] == [
        "nvidia-container-toolkit",
        "nvidia-driver-550-server",
        "nvidia-fabricmanager-550",
    ]
    assert nv.services["nvidia-fabricmanager.service"] and not nv.services["nvidia-vgpu-mgr.service"]
    assert {m.name for m in snap.modules} == {"nvidia", "nvidia_uvm", "nvidia_modeset", "mlx5_core"}
    assert snap.fingerprint.startswith("sha256:") and snap.fingerprint == snap.compute_fingerprint()


def test_mdev_vgpu_host(tmp_path: Path) -> None:
    t = SysTree(tmp_path)
    t.host()
    t.function("0000:3b:00.0", NV, T4, 0x030200, subsystem=(NV, 0x12A2), group=5, driver="nvidia")
    t.mdev_type("0000:3b:00.0", "nvidia-222", "GRID T4-1Q", 14)
    t.mdev_type("0000:3b:00.0", "nvidia-223", "GRID T4-2Q", 6)
    t.mdev("0000:3b:00.0", UUID_B, "nvidia-223")
    t.mdev("0000:3b:00.0", UUID_A, "nvidia-223")
    t.modules("nvidia", "nvidia_vgpu_vfio", "mdev", "vfio")
    t.nvidia_version("550.127.06")
    t.packages(("nvidia-vgpu-ubuntu-550", "550.127.06"))
    t.services("nvidia-vgpud.service", "nvidia-vgpu-mgr.service")
    snap = discover(tmp_path)
    assert snap.problems == []
    fn = snap.function("0000:3b:00.0")
    assert fn is not None
    assert [(m.type_id, m.name, m.available_instances, m.device_api) for m in fn.mdev_types] == [
        ("nvidia-222", "GRID T4-1Q", 14, "vfio-pci"),
        ("nvidia-223", "GRID T4-2Q", 6, "vfio-pci"),
    ]
    assert fn.mdev_types[0].description.startswith("num_heads=4")
    assert [(m.uuid, m.type_id, m.parent) for m in fn.mdevs] == [
        (UUID_A, "nvidia-223", "0000:3b:00.0"),
        (UUID_B, "nvidia-223", "0000:3b:00.0"),
    ]
    (gpu,) = snap.gpus
    assert (gpu.mode, gpu.mdevs, gpu.name) == (Mode.VGPU, [UUID_A, UUID_B], "TU104GL [Tesla T4]")
    assert snap.driver_state is DriverState.VGPU_HOST
    assert snap.nvidia.flavour is Flavour.VGPU and snap.nvidia.vgpu_vfio_loaded
    assert snap.nvidia.packages[0].flavour is Flavour.VGPU


def test_vendor_vgpu_on_sriov_vfs(tmp_path: Path) -> None:
    t = SysTree(tmp_path)
    t.host()
    pf = "0000:41:00.0"
    t.function(pf, NV, L40S, 0x030200, numa=0, group=50, driver="nvidia")
    # offset 4, stride 1: VF n is devfn 4+n, so VF 4 is device 01 — and virtfn10 must sort after virtfn9
    vfs = [str(PciAddressOf(0x4100 + 4 + n)) for n in range(12)]
    t.sriov(pf, 32, vfs, vf_driver="nvidia", first_group=51)
    creatable = {1147: "NVIDIA L40S-1Q", 1148: "NVIDIA L40S-2Q", 1155: "NVIDIA L40S-48Q"}
    for vf in vfs:
        t.vendor_vgpu(vf, creatable, 1148 if vf in (vfs[0], vfs[11]) else 0)
    t.modules("nvidia", "nvidia_vgpu_vfio", "vfio_pci_core", "vfio")
    t.nvidia_version("550.127.06")
    t.services("nvidia-vgpu-mgr.service")
    snap = discover(tmp_path)
    assert snap.problems == []
    pf_fn = snap.function(pf)
    assert pf_fn is not None and pf_fn.sriov is not None
    assert (pf_fn.sriov.total_vfs, pf_fn.sriov.num_vfs, pf_fn.sriov.vfs) == (32, 12, vfs)
    assert (pf_fn.sriov.offset, pf_fn.sriov.stride) == (4, 1)
    assert pf_fn.vf_addresses(12) == vfs  # the addresses worked out from offset and stride are the links'
    assert vfs[4] == "0000:41:01.0"
    vf = snap.function(vfs[0])
    assert vf is not None and vf.is_vf and vf.physfn == pf
    assert vf.vendor_vgpu is not None
    assert (vf.vendor_vgpu.creatable, vf.vendor_vgpu.current) == (creatable, 1148)
    assert len(snap.functions) == 13
    (gpu,) = snap.gpus  # VFs are never GPUs
    assert (gpu.address, gpu.vfs, gpu.vgpus, gpu.mode) == (pf, vfs, [vfs[0], vfs[11]], Mode.VGPU)
    assert snap.driver_state is DriverState.VGPU_HOST


def PciAddressOf(rid: int) -> str:
    from gpumode.domain import PciAddress

    return str(PciAddress.from_routing_id(0, rid))


def passthrough_host(root: Path) -> SysTree:
    """A VGA board with its HDA function and a USB-C controller, all in one group, all on vfio-pci."""
    t = SysTree(root)
    t.host()
    for fn, device, cls in (("0", A6000, 0x030000), ("1", A6000_HDA, 0x040300), ("2", 0x1AD6, 0x0C0330)):
        t.function(
            f"0000:65:00.{fn}", NV, device, cls, group=60, driver="vfio-pci", override="vfio-pci", numa=1
        )
    t.consumer("0000:65:00.0", "0000:65:00.1")
    t.modules("vfio_pci", "vfio_pci_core", "vfio_iommu_type1", "vfio")
    t.services()
    return t


def test_passthrough_host_with_companions(tmp_path: Path) -> None:
    passthrough_host(tmp_path)
    snap = discover(tmp_path)
    assert snap.problems == []
    vga = snap.function("0000:65:00.0")
    assert vga is not None
    assert (vga.driver, vga.driver_override, vga.consumers, vga.class_name) == (
        "vfio-pci",
        "vfio-pci",
        ["0000:65:00.1"],
        "VGA compatible controller",
    )
    (gpu,) = snap.gpus
    assert gpu.mode is Mode.PASSTHROUGH
    assert gpu.companions == ["0000:65:00.1", "0000:65:00.2"]
    assert snap.driver_state is DriverState.VFIO
    assert not snap.nvidia.loaded and snap.nvidia.flavour is None and snap.nvidia.version is None


def test_mixed_host_and_unbound_gpu(tmp_path: Path) -> None:
    t = datacenter_host(tmp_path)
    t.function("0000:9a:00.0", NV, H100, 0x030200, group=90, driver="vfio-pci")
    t.function("0000:ab:00.0", NV, H100, 0x030201, group=91)  # unusual prog-if: still a GPU
    snap = discover(tmp_path)
    modes = {g.address: g.mode for g in snap.gpus}
    assert modes["0000:9a:00.0"] is Mode.PASSTHROUGH and modes["0000:ab:00.0"] is Mode.NONE
    assert modes["0000:18:00.0"] is Mode.ACCEL
    assert snap.driver_state is DriverState.MIXED


def test_problems_are_reported_never_raised(tmp_path: Path) -> None:
    t = SysTree(tmp_path)
    t.write("etc/hostname", "from-etc\n")  # no proc/sys/kernel/hostname: etc/hostname is used
    d = t.function("0000:01:00.0", NV, H100, 0x030200, driver="nouveau")
    (d / "vendor").unlink()
    (d / "numa_node").write_text("banana\n")
    (t.sys / "bus/pci/drivers/nouveau").rename(t.sys / "bus/pci/drivers/gone")  # driver link now dangles
    pf = t.function("0000:02:00.0", NV, L40S, 0x030200, driver="nvidia")
    t.sriov("0000:02:00.0", 4, ["0000:02:00.4"])
    (pf / "sriov_numvfs").write_text("2\n")
    t.vendor_vgpu("0000:02:00.4", {1: "x"})
    (t.dirs["0000:02:00.4"] / "nvidia/creatable_vgpu_types").write_text("ID    : vGPU Name\nnot a line\n")
    (t.sys / "bus/pci/devices/junk").mkdir()
    t.consumer("0000:01:00.0", "0000:02:00.4")
    (t.dirs["0000:01:00.0"] / "consumer:pci:0000:77:00.0").symlink_to("nowhere")

    snap = discover(tmp_path)
    text = "\n".join(snap.problems)
    expected = [
        "sys/bus/pci/devices/0000:01:00.0/vendor: missing",
        "sys/bus/pci/devices/0000:01:00.0/numa_node: unreadable value 'banana'",
        "sys/bus/pci/devices/0000:01:00.0/driver: dangling link (no sys/bus/pci/drivers/nouveau)",
        "sys/bus/pci/devices/0000:02:00.0/sriov_numvfs: says 2 VFs but 1 virtfn links exist",
        "sys/bus/pci/devices/0000:02:00.4/nvidia/creatable_vgpu_types: unreadable line 'not a line'",
        "sys/bus/pci/devices/junk: not a PCI address; ignored",
        "consumer:pci:0000:77:00.0: dangling link (no function 0000:77:00.0)",
        "no function has an iommu_group link",
        "proc/modules: missing",
        "proc/sys/kernel/osrelease: missing",
    ]
    for needle in expected:
        assert needle in text, f"{needle!r} not in problems:\n{text}"
    assert snap.hostname == "from-etc" and snap.kernel is None
    fn = snap.function("0000:01:00.0")
    assert fn is not None and fn.vendor == -1 and fn.numa_node is None
    assert snap.gpus[0].address == "0000:02:00.0"  # unknown vendor is not taken for NVIDIA
    assert snap.nvidia.loaded  # a function bound to nvidia proves it, even without proc/modules


def test_bad_sriov_layout_files_are_problems(tmp_path: Path) -> None:
    """Garbage offset/stride leave them unknown (None) with a problem; a link where offset and stride do not
    put the VF is a problem; an old kernel without the files is a problem, not a crash."""
    t = SysTree(tmp_path)
    t.host()
    for pf in ("0000:41:00.0", "0000:42:00.0", "0000:43:00.0", "0000:44:00.0"):
        t.function(pf, NV, L40S, 0x030200, group=int(pf[5:7], 16), driver="nvidia")
    t.sriov("0000:41:00.0", 4, [])
    (t.dirs["0000:41:00.0"] / "sriov_offset").write_text("banana\n")
    (t.dirs["0000:41:00.0"] / "sriov_stride").write_text("70000\n")
    t.sriov("0000:42:00.0", 4, ["0000:42:00.4", "0000:42:00.6"])  # VF 1 should be at 42:00.5
    t.sriov("0000:43:00.0", 4, [], offset=None)
    t.sriov("0000:44:00.0", 4, [], offset=0)
    t.modules("nvidia")
    snap = discover(tmp_path)
    base = "sys/bus/pci/devices"
    assert sorted(p for p in snap.problems if p.startswith(base)) == [
        f"{base}/0000:41:00.0/sriov_offset: unreadable value 'banana' (expected a 16-bit count)",
        f"{base}/0000:41:00.0/sriov_stride: unreadable value '70000' (expected a 16-bit count)",
        f"{base}/0000:42:00.0/virtfn1: points at 0000:42:00.6, but sriov_offset 4 and sriov_stride 1 put "
        "VF 1 at 0000:42:00.5",
        f"{base}/0000:43:00.0/sriov_offset: missing",
        f"{base}/0000:43:00.0/sriov_stride: missing",
        f"{base}/0000:44:00.0/sriov_offset: sriov_offset is 0: VF 0 would be the PF itself",
    ]
    layouts = {fn.address: (fn.sriov.offset, fn.sriov.stride) for fn in snap.functions if fn.sriov}
    assert layouts == {
        "0000:41:00.0": (None, None),
        "0000:42:00.0": (4, 1),
        "0000:43:00.0": (None, None),
        "0000:44:00.0": (0, 1),
    }
    assert snap.fingerprint == snap.compute_fingerprint()
    assert HostSnapshot.from_dict(json.loads(snap.to_json())) == snap


def test_empty_root_is_all_problems(tmp_path: Path) -> None:
    snap = discover(tmp_path)
    assert snap.functions == [] and snap.gpus == [] and snap.driver_state is DriverState.NONE
    assert any(p.startswith("sys/bus/pci/devices: missing") for p in snap.problems)
    assert snap.hostname == ""


def test_fingerprint_is_stable_and_follows_every_change(tmp_path: Path) -> None:
    t = datacenter_host(tmp_path)
    first = discover(tmp_path).fingerprint
    assert discover(tmp_path).fingerprint == first
    assert discover(Host(tmp_path)).fingerprint == first
    (t.dirs["0000:2a:00.0"] / "driver_override").write_text("vfio-pci\n")
    second = discover(tmp_path).fingerprint
    assert second != first
    (t.dirs["0000:2a:00.0"] / "numa_node").write_text("0\n")
    assert discover(tmp_path).fingerprint not in (first, second)


def test_json_round_trip(tmp_path: Path) -> None:
    datacenter_host(tmp_path)
    snap = discover(tmp_path)
    again = HostSnapshot.from_dict(json.loads(snap.to_json()))
    assert again == snap
    assert again.compute_fingerprint() == snap.fingerprint


def test_reads_only_what_the_listing_shows(tmp_path: Path) -> None:
    """Every open hits a file that exists (no failed opens): the speed promise of the module docstring."""
    datacenter_host(tmp_path)

    class Counting(SysReader):
        missing = 0

        def read(self, path: str) -> str | None:
            text = super().read(path)
            if text is None and "/sys/" in path:
                Counting.missing += 1
            return text

    discover(tmp_path, reader=Counting())
    assert Counting.missing == 0


@pytest.mark.parametrize("root", ["/definitely/not/here"])
def test_missing_root_is_a_problem_not_a_crash(root: str) -> None:
    snap = discover(root)
    assert snap.functions == [] and snap.problems
