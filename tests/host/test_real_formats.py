"""gpumode's parsers fed files in the exact formats real hosts write, with NVIDIA's real type ids and names:
a real L40S VF's ``creatable_vgpu_types`` (vGPU 17), a T4's ``mdev_supported_types`` names, an A2 board told
from an A16 by its subsystem id, and discovery plus planning on such a plain tree."""

from __future__ import annotations

from pathlib import Path

from test_discover_tree import SysTree

from gpumode.domain import Flavour, Mode, SwitchRequest
from gpumode.host import vgpu
from gpumode.host.discover import discover
from gpumode.modes.catalog import load_catalog
from gpumode.modes.plan import plan_switch
from gpumode.modes.policy import load_whitelist, vgpu_offer
from published_vgpu_types import PUBLISHED

# As a real L40S host prints it (harvester/pcidevices quotes the same listing): header, "%-5d : %s" lines.
L40S_CREATABLE = (
    "ID    : vGPU Name\n"
    "1145  : NVIDIA L40S-1B\n1146  : NVIDIA L40S-2B\n1147  : NVIDIA L40S-1Q\n1148  : NVIDIA L40S-2Q\n"
    "1149  : NVIDIA L40S-3Q\n1150  : NVIDIA L40S-4Q\n1151  : NVIDIA L40S-6Q\n1152  : NVIDIA L40S-8Q\n"
    "1153  : NVIDIA L40S-12Q\n1154  : NVIDIA L40S-16Q\n1155  : NVIDIA L40S-24Q\n1156  : NVIDIA L40S-48Q\n"
    "1157  : NVIDIA L40S-1A\n1158  : NVIDIA L40S-2A\n1159  : NVIDIA L40S-3A\n1160  : NVIDIA L40S-4A\n"
    "1161  : NVIDIA L40S-6A\n1162  : NVIDIA L40S-8A\n1163  : NVIDIA L40S-12A\n1164  : NVIDIA L40S-16A\n"
    "1165  : NVIDIA L40S-24A\n1166  : NVIDIA L40S-48A\n2164  : NVIDIA L40S-3B\n"
)
NV = 0x10DE
CATALOG = load_catalog()


def test_a_real_creatable_vgpu_types_listing_parses_to_nvidias_ids() -> None:
    parsed = vgpu.parse_creatable(L40S_CREATABLE)
    assert {name: type_id for type_id, name in parsed.items()} == PUBLISHED[(0x26B9, 0x1851)]


def test_discovery_reads_real_vf_and_mdev_files(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    tree.host()
    tree.modules("nvidia", "nvidia_vgpu_vfio")
    tree.nvidia_version("550.127.06")
    tree.function("0000:17:00.0", NV, 0x26B9, 0x030200, subsystem=(NV, 0x1851), group=1, driver="nvidia")
    tree.sriov("0000:17:00.0", 32, ["0000:17:00.4"], vf_driver="nvidia", first_group=50)
    vf = tree.dirs["0000:17:00.4"]
    (vf / "nvidia").mkdir()
    (vf / "nvidia/creatable_vgpu_types").write_text(L40S_CREATABLE)
    (vf / "nvidia/current_vgpu_type").write_text("0\n")
    tree.function("0000:3b:00.0", NV, 0x1EB8, 0x030200, subsystem=(NV, 0x12A2), group=2, driver="nvidia")
    for type_id, name in ((222, "GRID T4-1B"), (252, "GRID T4-1B4"), (319, "GRID T4-4C")):
        tree.mdev_type(
            "0000:3b:00.0",
            f"nvidia-{type_id}",
            name,
            4,
            "num_heads=1, frl_config=60, framebuffer=4096M, max_resolution=4096x2160, max_instance=4",
        )
    tree.services()
    snap = discover(tmp_path)
    assert snap.nvidia.flavour is Flavour.VGPU
    vendor = snap.function("0000:17:00.4")
    assert vendor is not None and vendor.vendor_vgpu is not None
    assert vendor.vendor_vgpu.creatable[2164] == "NVIDIA L40S-3B" and len(vendor.vendor_vgpu.creatable) == 23
    t4 = snap.function("0000:3b:00.0")
    assert t4 is not None
    assert [(t.type_id, t.name) for t in t4.mdev_types] == [
        ("nvidia-222", "GRID T4-1B"),
        ("nvidia-252", "GRID T4-1B4"),
        ("nvidia-319", "GRID T4-4C"),
    ]
    assert "frl_config=60" in t4.mdev_types[2].description


def _board(tmp_path: Path, subsystem: int) -> SysTree:
    tree = SysTree(tmp_path)
    tree.host()
    tree.modules("ext4")
    tree.function("0000:17:00.0", NV, 0x25B6, 0x030200, subsystem=(NV, subsystem), group=1)
    tree.sriov("0000:17:00.0", 16, [])
    tree.services()
    return tree


def test_an_a2_is_offered_a2_types_and_an_a16_a16_types(tmp_path: Path) -> None:
    for subsystem, board, prefix in ((0x157E, "a2", "NVIDIA A2-"), (0x14A9, "a16", "NVIDIA A16-")):
        _board(tmp_path / board, subsystem)
        snap = discover(tmp_path / board)
        offer = vgpu_offer(snap, snap.gpus[0], CATALOG)
        assert offer is not None and offer.source == "catalog"
        assert offer.types and all(t.name.startswith(prefix) for t in offer.types)
        assert {t.name: t.id for t in offer.types} == PUBLISHED[(0x25B6, subsystem)]
        request = SwitchRequest(Mode.VGPU, vgpu_type=f"{prefix}4Q", vgpu_count=1)
        p = plan_switch(snap, [], request, catalog=CATALOG, whitelist=load_whitelist())
        (create,) = [s for s in p.steps if s.action == "vgpu.create"]
        assert create.params["type_id"] == f"nvidia-{PUBLISHED[(0x25B6, subsystem)][f'{prefix}4Q']}"


def test_a_25b6_board_of_unknown_subsystem_is_offered_no_one_elses_types(tmp_path: Path) -> None:
    _board(tmp_path, 0x1234)
    snap = discover(tmp_path)
    assert vgpu_offer(snap, snap.gpus[0], CATALOG) is None
