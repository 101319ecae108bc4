"""The driver catalog: the shipped default, its agreement with the emulated host, its validation errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gpumode.domain import Flavour
from gpumode.emulated.fixtures.models import MODELS
from gpumode.modes.catalog import ACTIONS, load_catalog, parse_catalog
from gpumode.yamlfile import ConfigError
from published_vgpu_types import PUBLISHED


def default_data() -> dict[str, Any]:
    text = (Path(__file__).parents[2] / "src/gpumode/data/catalog.yaml").read_text()
    data: dict[str, Any] = yaml.safe_load(text)
    return data


def test_default_catalog_loads_with_the_expected_drivers() -> None:
    c = load_catalog()
    dc, vg = c.flavour(Flavour.DATACENTER), c.flavour(Flavour.VGPU)
    assert [p.name for p in dc.packages(nvswitch=False)] == [
        "nvidia-driver-550-server",
        "nvidia-container-toolkit",
    ]
    assert [p.name for p in dc.packages(nvswitch=True)] == [
        "nvidia-driver-550-server",
        "nvidia-fabricmanager-550",
        "nvidia-container-toolkit",
    ]
    assert dc.modules == ("nvidia", "nvidia_uvm", "nvidia_modeset")
    assert dc.units(nvswitch=False) == ["nvidia-persistenced.service"]
    assert [p.name for p in vg.installer.packages] == ["nvidia-vgpu-ubuntu-550"]
    assert vg.modules == ("nvidia", "nvidia_vgpu_vfio")
    assert vg.units(nvswitch=False) == ["nvidia-vgpud.service", "nvidia-vgpu-mgr.service"]
    assert set(c.estimates) == set(ACTIONS)
    assert c.flavour_of_package("nvidia-vgpu-ubuntu-550") is Flavour.VGPU
    t4 = c.model(0x1EB8)
    assert t4 is not None and t4.vgpu_interface == "mdev" and t4.vgpu_parent == "pf"
    l40s = c.model(0x26B9)
    assert l40s is not None and l40s.vgpu_interface == "vendor" and l40s.vgpu_parent == "vf"


@pytest.mark.parametrize("key", sorted(MODELS))
def test_catalog_matches_the_emulated_gpu_models(key: str) -> None:
    """Plans made before the vGPU manager is loaded must name what the (emulated) host then shows."""
    spec = MODELS[key]
    model = load_catalog().model(spec.device, (0x10DE, spec.subsystem_device))
    assert model is not None
    assert model.sriov_vfs == spec.sriov_total_vfs
    assert model.vgpu_interface == spec.vgpu_interface
    assert (model.vgpu_parent == "vf") == spec.vgpus_on_vfs
    assert [(t.id, t.name, t.framebuffer_mib, t.max_instances) for t in model.vgpu_types] == [
        (t.type_id, t.name, t.framebuffer_mib, t.max_instances) for t in spec.vgpu_types
    ]


def test_catalog_can_be_overridden_by_a_file(tmp_path: Path) -> None:
    data = default_data()
    data["flavours"]["vgpu"]["installer"] = {
        "kind": "run",
        "command": ["sh", "/opt/NVIDIA-Linux-x86_64-550.127.06-vgpu-kvm.run", "--silent"],
        "remove_command": ["nvidia-uninstall", "--silent"],
        "detect_path": "/usr/bin/nvidia-vgpud",
    }
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(data))
    c = load_catalog(path)
    assert c.source == str(path)
    assert c.flavour(Flavour.VGPU).installer.kind == "run"
    assert c.flavour(Flavour.VGPU).installer.detect_path == "/usr/bin/nvidia-vgpud"


def mutate(path: list[str | int], value: Any) -> dict[str, Any]:
    data = default_data()
    node: Any = data
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["version"], "v2", "version: unsupported catalog version 'v2'"),
        (
            ["flavours", "vgpu", "modules"],
            ["nvidia_vgpu_vfio"],
            "flavours.vgpu.modules: must list the modules",
        ),
        (["flavours", "datacenter", "servics"], [], "flavours.datacenter: unknown key 'servics'"),
        (["flavours", "datacenter", "services"], KeyError, "flavours.datacenter: missing key 'services'"),
        (["flavours", "vgpu", "sriov_manage"], KeyError, "missing key 'sriov_manage'"),
        (
            ["flavours", "datacenter", "installer", "packages", 1, "when"],
            "sometimes",
            "flavours.datacenter.installer.packages[1].when: expected one of always, nvswitch",
        ),
        (["flavours", "datacenter", "installer", "packages"], [], "needs at least one package"),
        (["estimates", "vm.reboot"], 5, "estimates.vm.reboot: unknown action 'vm.reboot'"),
        (["estimates", "vm.shutdown"], -1, "expected a non-negative number"),
        (
            ["gpu_models", "10de:26b9", "sriov_vfs"],
            KeyError,
            "gpu_models.10de:26b9.vgpu.interface: the vendor interface",
        ),
        (
            ["gpu_models", "10de:1eb8", "vgpu", "types", 0, "max_instances"],
            0,
            "types[0].max_instances: must be at least 1",
        ),
        (["gpu_models", "10de:1eb8", "vgpu", "types", 1, "id"], 222, "types[1]: duplicate vGPU type id 222"),
        (["gpu_models", "10de:1eb8", "name"], "", "gpu_models.10de:1eb8.name: expected a non-empty string"),
    ],
)
def test_invalid_catalogs_name_the_key_path_and_problem(
    path: list[str | int], value: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_catalog(mutate(path, value), "my-catalog.yaml")
    assert str(err.value).startswith("my-catalog.yaml: ")
    assert message in str(err.value)


def test_unquoted_device_ids_are_explained() -> None:
    data = default_data()
    data["gpu_models"][2330] = data["gpu_models"].pop("10de:2330")
    with pytest.raises(ConfigError, match="must be a quoted string"):
        parse_catalog(data, "c.yaml")


def test_unreadable_and_malformed_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read"):
        load_catalog(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: [v1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_catalog(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"empty\.yaml: .*expected a mapping, got nothing"):
        load_catalog(empty)


@pytest.mark.parametrize("board", sorted(PUBLISHED))
def test_catalog_carries_nvidias_published_type_ids(board: tuple[int, int]) -> None:
    """Every type of the board, with NVIDIA's id: a plan that writes the wrong id creates another type."""
    device, subsystem = board
    model = load_catalog().model(device, (0x10DE, subsystem))
    assert model is not None
    assert {t.name: t.id for t in model.vgpu_types} == PUBLISHED[board]


def test_one_pci_id_two_boards_each_gets_its_own_types() -> None:
    c = load_catalog()
    a2, a16 = c.model(0x25B6, (0x10DE, 0x157E)), c.model(0x25B6, (0x10DE, 0x14A9))
    assert a2 is not None and a16 is not None and a2.name == "NVIDIA A2" and a16.name == "NVIDIA A16"
    assert all(t.name.startswith("NVIDIA A2-") for t in a2.vgpu_types)
    assert {t.id for t in a2.vgpu_types}.isdisjoint(t.id for t in a16.vgpu_types)
    # a 25b6 board whose subsystem the catalog does not list is offered nobody's types
    assert c.model(0x25B6, (0x10DE, 0x1234)) is None and c.model(0x25B6) is None


def test_the_interface_is_predicted_from_the_branch_and_the_kernel() -> None:
    c = load_catalog()
    a16, t4 = c.model(0x25B6, (0x10DE, 0x14A9)), c.model(0x1EB8)
    rtx = c.model(0x1E30)
    assert a16 is not None and t4 is not None and rtx is not None
    assert c.predicted_interface(a16, 550, "6.8.0-45-generic") == ("mdev", "vf")
    assert c.predicted_interface(a16, 580, "6.5.0-1-amd64") == ("mdev", "vf")
    assert c.predicted_interface(a16, 580, "6.8.0-45-generic") == ("vendor", "vf")
    assert c.predicted_interface(t4, 550, "6.8.0") == ("mdev", "pf")
    assert c.predicted_interface(rtx, 580, "6.11.0") is None  # no SR-IOV: no vendor interface, no vGPU
    assert c.predicted_interface(a16, None, "6.8.0") == ("mdev", "vf")  # unknown branch: the model's entry


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("25b6 157e", "GPU model keys are quoted PCI ids"),
        ("10de:25b6:10DE:157E", "GPU model keys are quoted PCI ids"),
    ],
)
def test_bad_model_keys_are_explained(key: str, message: str) -> None:
    data = default_data()
    data["gpu_models"][key] = {"name": "x", "alias": "x"}
    with pytest.raises(ConfigError, match=message):
        parse_catalog(data, "c.yaml")


def test_a_board_listed_twice_is_refused() -> None:
    data = default_data()
    data["gpu_models"]["26b9"] = {"name": "x", "alias": "x"}  # the short form of 10de:26b9
    with pytest.raises(ConfigError, match="duplicate GPU model '26b9'"):
        parse_catalog(data, "c.yaml")
