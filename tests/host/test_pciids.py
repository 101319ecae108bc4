"""Names from the shipped pci.ids, and the block lookup on a hand-written database."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpumode.host.pciids import DEFAULT_PATH, PciIds

NVIDIA = 0x10DE


@pytest.fixture(scope="module")
def ids() -> PciIds:
    return PciIds()


def test_shipped_database_is_the_documented_version(ids: PciIds) -> None:
    assert ids.version == "2026.06.16"


@pytest.mark.parametrize(
    ("device", "name"),
    [
        (0x2335, "GH100 [H200 SXM 141GB]"),
        (0x26B9, "AD102GL [L40S]"),
        (0x2901, "GB100 [B200]"),
        (0x2330, "GH100 [H100 SXM5 80GB]"),
        (0x1EB8, "TU104GL [Tesla T4]"),
        (0x25B6, "GA107GL [A2 / A16]"),
    ],
)
def test_data_center_gpus_resolve(ids: PciIds, device: int, name: str) -> None:
    assert ids.device(NVIDIA, device) == name


def test_vendor_names(ids: PciIds) -> None:
    assert ids.vendor(NVIDIA) == "NVIDIA Corporation"
    assert ids.vendor(0x1AF4) == "Red Hat, Inc."
    assert ids.vendor(0x8086) == "Intel Corporation"
    assert ids.vendor(0x0002) is None  # not assigned in this database


def test_device_ids_are_looked_up_under_their_vendor_only(ids: PciIds) -> None:
    # 2204 is an RTX 3090 under NVIDIA, a VIA host bridge under 1106: the vendor block decides.
    assert ids.device(NVIDIA, 0x2204) == "GA102 [GeForce RTX 3090]"
    assert ids.device(0x1106, 0x2204) == "K8M800 Host Bridge"
    assert ids.device(NVIDIA, 0xFFF0) is None


def test_subsystem_names(ids: PciIds) -> None:
    assert ids.subsystem(NVIDIA, 0x2204, NVIDIA, 0x147D) == "GeForce RTX 3090 Founders Edition"
    assert ids.subsystem(0x1AF4, 0x1041, 0x1AF4, 0x1100) == "QEMU"
    # the same subsystem ids under another device do not match
    assert ids.subsystem(NVIDIA, 0x2330, NVIDIA, 0x147D) is None


@pytest.mark.parametrize(
    ("class_code", "name"),
    [
        (0x030200, "3D controller"),
        (0x030000, "VGA compatible controller"),
        (0x040300, "Audio device"),
        (0x068000, "Bridge"),
        (0x060400, "PCI bridge"),
        (0x020000, "Ethernet controller"),
        (0xFFFF00, "Unassigned class"),  # base class named, subclass not: the base class name
    ],
)
def test_class_names(ids: PciIds, class_code: int, name: str) -> None:
    assert ids.class_name(class_code) == name


def test_prog_if_names(ids: PciIds) -> None:
    assert ids.prog_if_name(0x030000) == "VGA controller"
    assert ids.prog_if_name(0x030200) is None
    assert ids.class_name(0x7F0000) is None


def test_only_the_blocks_asked_for_are_located(ids: PciIds) -> None:
    fresh = PciIds()
    fresh.device(NVIDIA, 0x2335)
    assert list(fresh._blocks) == [b"\n10de  "]
    assert list(fresh._devices) == [NVIDIA]


def test_lookups_are_fast(ids: PciIds) -> None:
    fresh = PciIds()
    start = time.perf_counter()
    for device in range(0x2300, 0x2400):  # 256 first lookups in NVIDIA's block, the biggest there is
        fresh.device(NVIDIA, device)
    for base in range(0x14):
        fresh.class_name(base << 16)
    assert time.perf_counter() - start < 0.25  # typically ~10 ms, including the read of the file


def test_block_parsing_on_a_hand_written_database(tmp_path: Path) -> None:
    db = tmp_path / "pci.ids"
    db.write_text(
        "#\tVersion: 2099.01.01\n"
        "1234  First Vendor\n"
        "# a comment inside the block does not end it\n"
        "\t0001  Widget\n"
        "\t\t1234 0042  Widget Pro\n"
        "\n"
        "\t0002  Gadget\n"
        "1235  Second Vendor\n"
        "\t0001  Other widget\n"
        "C 03  Display controller\n"
        "\t02  3D controller\n"
        "\t\t00  Boring\n"
    )
    ids = PciIds(db)
    assert ids.version == "2099.01.01"
    assert ids.vendor(0x1234) == "First Vendor"
    assert ids.device(0x1234, 0x0001) == "Widget"
    assert ids.device(0x1234, 0x0002) == "Gadget"
    assert ids.subsystem(0x1234, 0x0001, 0x1234, 0x0042) == "Widget Pro"
    assert ids.device(0x1235, 0x0001) == "Other widget"
    assert ids.device(0x1235, 0x0002) is None  # the first block ended at the next vendor line
    assert ids.class_name(0x030200) == "3D controller"
    assert ids.prog_if_name(0x030200) == "Boring"


def test_missing_database_gives_no_names_and_no_error(tmp_path: Path) -> None:
    ids = PciIds(tmp_path / "absent.ids")
    assert ids.vendor(NVIDIA) is None
    assert ids.class_name(0x030200) is None
    assert ids.version is None


def test_default_path_is_the_shipped_file() -> None:
    assert DEFAULT_PATH.is_file()
    assert DEFAULT_PATH.parts[-2:] == ("data", "pci.ids")
