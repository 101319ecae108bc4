"""gpumode's reading of nova-compute's merged configuration (``novamerge``) against nova's own (its option
definitions, oslo.config, ``nova.pci`` spec and alias parsing; marked ``nova``), and the switch it refuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpumode.cloud.openstack.http import OpenStackError
from gpumode.cloud.openstack.novamerge import NovaConfigError, merge, parse_ini, problems, reading_order
from gpumode.domain import Mode
from gpumode.host.discover import discover

from .conftest import Stack
from .realnova import NOVA_CONF, NOVA_CONF_D, nova_parse

NIC = {"vendor_id": "8086", "product_id": "1533", "address": "0000:02:00.0"}
T4_ANY = {"vendor_id": "10de", "product_id": "1eb8"}
ALIAS = {"name": "nic", "vendor_id": "8086", "product_id": "1533", "device_type": "type-PCI"}
DROPIN = "gpumode.conf"

# (operator's nova.conf, {conf.d file: text}) — gpumode's drop-in is conf.d/gpumode.conf
CASES: dict[str, tuple[str, dict[str, str]]] = {
    "accel drop-in leaves the operator's mdev types": (
        "[devices]\nenabled_mdev_types = nvidia-231\n[pci]\nreport_in_placement = true\n",
        {DROPIN: "# gpumode\n\n[pci]\nreport_in_placement = True\n"},
    ),
    "vgpu drop-in replaces them; specs and aliases add up": (
        "[devices]\nenabled_mdev_types = nvidia-222, nvidia-223\n"
        "[mdev_nvidia-231]\ndevice_addresses = 0000:3b:00.0\n"
        f"[pci]\ndevice_spec = {json.dumps(NIC)}\nalias = {json.dumps(ALIAS)}\n",
        {
            DROPIN: "[devices]\nenabled_mdev_types = nvidia-231\n[mdev_nvidia-231]\n"
            "device_addresses = 0000:18:00.0,0000:3b:00.0\n"
            '[pci]\ndevice_spec = {"vendor_id":"10de","product_id":"1eb8","address":"0000:99:00.0"}\n'
            'alias = {"name":"t4","vendor_id":"10de","product_id":"1eb8","device_type":"type-PCI"}\n'
        },
    ),
    "a later conf.d file wins; the deprecated name still counts": (
        f"[pci]\npassthrough_whitelist = [{json.dumps(T4_ANY)}, {json.dumps(NIC)}]\n",
        {DROPIN: "[pci]\nreport_in_placement = True\n", "zz-local.conf": "[pci]\nreport_in_placement = no\n"},
    ),
}


def write_case(root: Path, case: tuple[str, dict[str, str]]) -> tuple[Path, Path]:
    conf, conf_d = root / NOVA_CONF.lstrip("/"), root / NOVA_CONF_D.lstrip("/")
    conf_d.mkdir(parents=True)
    conf.write_text(case[0])
    for name, text in case[1].items():
        (conf_d / name).write_text(text)
    return conf, conf_d


def ours(conf: Path, conf_d: Path) -> dict[str, Any]:
    order = reading_order(str(conf), [str(p) for p in conf_d.iterdir()])
    merged = merge([(p, Path(p).read_text()) for p in order])
    types, _ = merged.enabled_mdev_types()
    addresses = {}
    for t in types:
        found = merged.get(f"mdev_{t}", "device_addresses")
        addresses[t] = [a.strip() for a in found.value.split(",")] if found else []
    return {
        "enabled_mdev_types": types,
        "device_addresses": addresses,
        "device_spec": [s for s, _ in merged.device_specs()],
        "alias": [json.loads(v.value) for v in merged.multi.get(("pci", "alias"), [])],
        "report_in_placement": merged.report_in_placement()[0],
    }


@pytest.mark.nova
def test_the_merge_rules_are_novas(tmp_path: Path, nova_venv_python: str) -> None:
    paths = {name: write_case(tmp_path / str(i), case) for i, (name, case) in enumerate(CASES.items())}
    requests = [{"config_files": [str(c)], "config_dirs": [str(d)]} for c, d in paths.values()]
    for (name, (conf, conf_d)), theirs in zip(
        paths.items(), nova_parse(nova_venv_python, requests), strict=True
    ):
        assert theirs["ok"], (name, theirs["error"])
        del theirs["ok"], theirs["error"]
        assert ours(conf, conf_d) == theirs, name


@pytest.mark.nova
def test_every_dropin_gpumode_renders_parses_in_nova(real_stack: Stack, tmp_path: Path) -> None:
    """Drop-ins for vgpu, passthrough (with alias and PCI-in-Placement) and a mixed host, through nova's own
    parsers (an alias or spec nova rejects makes nova-compute or nova-api refuse to start)."""
    s = real_stack
    dropins = []
    s.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2, gpus=["0000:18:00.0"])
    s.switch(Mode.PASSTHROUGH, gpus=["0000:99:00.0"])
    dropins.append(s.platform.render(discover(s.host), alias="t4"))
    s.switch(Mode.PASSTHROUGH)
    dropins.append(s.platform.render(discover(s.host)))
    requests = []
    for i, text in enumerate(dropins):
        (tmp_path / f"{i}.conf").write_text(text)
        requests.append({"config_files": [str(tmp_path / f"{i}.conf")], "config_dirs": []})
    mixed, passthrough = nova_parse(s.real.python, requests)
    assert mixed["ok"] and passthrough["ok"], (mixed["error"], passthrough["error"])
    assert mixed["enabled_mdev_types"] == ["nvidia-231"]
    assert mixed["device_addresses"] == {"nvidia-231": ["0000:18:00.0"]}
    assert [a["name"] for a in mixed["alias"]] == ["t4"] and mixed["report_in_placement"] is True
    assert [d["address"] for d in passthrough["device_spec"]] == [
        "0000:18:00.0", "0000:3b:00.0", "0000:99:00.0", "0000:b0:00.0"
    ]  # fmt: skip


def test_a_switch_the_merged_config_would_not_give_is_refused_naming_file_and_option(stack: Stack) -> None:
    """The operator's nova.conf keeps enabled_mdev_types; after a switch to accel nova-compute would still
    offer vGPUs. Card set-up refuses before writing or restarting anything."""
    s = stack
    s.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    s.platform.set_up_cards(discover(s.host))
    conf = s.host.path(NOVA_CONF)
    conf.write_text(
        "[DEFAULT]\nhost = t4\n[devices]\nenabled_mdev_types = nvidia-231\n"
        "[pci]\nreport_in_placement = True\n"
    )
    dropin = s.host.path(s.config.nova_dropin).read_text()
    restarts = s.reporter.restarts
    s.switch(Mode.ACCEL)
    with pytest.raises(
        OpenStackError, match=r"/etc/nova/nova.conf: \[devices\] enabled_mdev_types = nvidia-231 stays"
    ):
        s.platform.set_up_cards(discover(s.host))
    assert s.host.path(s.config.nova_dropin).read_text() == dropin and s.reporter.restarts == restarts

    conf.write_text("[pci]\n" + f"device_spec = {json.dumps(T4_ANY)}\n")  # claims every T4, and no PCI report
    with pytest.raises(OpenStackError) as err:
        s.platform.set_up_cards(discover(s.host))
    assert "/etc/nova/nova.conf: [pci] device_spec" in str(err.value) and "claims GPU 0000:18:00.0" in str(
        err.value
    )
    assert "[pci] report_in_placement" not in str(
        err.value
    )  # gpumode's drop-in sets it, later than nova.conf

    conf.write_text("[DEFAULT]\ndebug = true\n")
    assert "restarted" in s.platform.set_up_cards(discover(s.host))


def test_unreadable_lines_name_the_file_and_line() -> None:
    with pytest.raises(NovaConfigError, match=r"nova.conf line 2: option 'debug' before any section"):
        parse_ini("# x\ndebug = true\n", "nova.conf")
    merged = merge([("a.conf", "[pci]\nreport_in_placement = maybe\n")])
    with pytest.raises(
        NovaConfigError, match=r"a.conf: \[pci\] report_in_placement = 'maybe' is not a boolean"
    ):
        merged.report_in_placement()
    assert problems(merge([]), _empty_snapshot(), dropin="d", pci_in_placement=False) == []


def _empty_snapshot() -> Any:
    from gpumode.domain import DriverState, HostSnapshot, NvidiaDriver

    return HostSnapshot("h", None, [], [], [], [], NvidiaDriver(), DriverState.NONE)


@pytest.mark.parametrize(
    ("pattern", "claims"),
    [("0000:18:00.0", True), ("18:00.0", True), ("*:18:00.*", True), ("0000:18:*.*", True),
     ("0000:3b:00.0", False), ("0000:18:00.1", False), ("*:*:*.*", True)],
)  # fmt: skip
def test_device_spec_addresses_match_as_novas_globs(pattern: str, claims: bool, stack: Stack) -> None:
    """nova's ``[[domain]:][bus]:[slot][.[function]]`` with ``*``: an operator's spec that matches a GPU the
    switch leaves out of passthrough is named."""
    spec = {"vendor_id": "10de", "product_id": "1eb8", "address": pattern}
    merged = merge([("/etc/nova/nova.conf", f"[pci]\ndevice_spec = {json.dumps(spec)}\n")])
    found = problems(merged, discover(stack.host), dropin="d", pci_in_placement=False)
    assert any("claims GPU 0000:18:00.0" in p for p in found) is claims, found
