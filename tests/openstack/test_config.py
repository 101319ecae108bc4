"""The drop-in renderer, Cyborg device profiles, and the server's ``cloud = "openstack"`` setting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from gpumode.cloud.base import VgpuProfile
from gpumode.cloud.embedded import metadata
from gpumode.cloud.openstack.config import OpenStackConfig
from gpumode.cloud.openstack.factory import build_clients
from gpumode.cloud.openstack.http import OpenStackError
from gpumode.cloud.openstack.novaconf import RenderError, render_dropin
from gpumode.cloud.openstack.platform import OpenStackPlatform
from gpumode.emulated.create import create_host
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.server.settings import SettingsError, load_settings

from .reporter import parse_dropin
from .services import FakeCyborg, Served


def test_mixed_host_renders_both_sections_with_per_address_specs(host: Host) -> None:
    from gpumode.domain import Mode, SwitchRequest, VmPolicy
    from gpumode.modes import engine

    assert engine.apply(
        host, SwitchRequest(Mode.VGPU, ["0000:18:00.0"], "GRID T4-2Q", 2, None, VmPolicy.ALL)
    ).ok
    assert engine.apply(host, SwitchRequest(Mode.PASSTHROUGH, ["0000:99:00.0"], vm_policy=VmPolicy.ALL)).ok
    conf = parse_dropin(render_dropin(discover(host), pci_in_placement=False))
    (type_id,) = conf["devices"]["enabled_mdev_types"]
    assert conf[f"mdev_{type_id}"]["device_addresses"] == ["0000:18:00.0"]
    assert conf["pci"]["device_spec"] == ['{"vendor_id":"10de","product_id":"1eb8","address":"0000:99:00.0"}']
    assert conf["pci"]["alias"] == [
        '{"name":"gpumode-10de-1eb8","vendor_id":"10de","product_id":"1eb8","device_type":"type-PCI"}'
    ]
    assert "report_in_placement" not in conf["pci"]


def test_vendor_vfio_vgpus_are_refused_by_name(tmp_path: Path) -> None:
    snapshot = discover(create_host("l40s-sriov", tmp_path / "h"))
    with pytest.raises(RenderError, match=r"GPU 0000:\S+ serves vGPUs through the vendor VFIO interface"):
        render_dropin(snapshot)


def platform_with_cyborg(
    profiles: list[dict[str, Any]], url: str | None = None
) -> tuple[OpenStackPlatform, Served]:
    served = Served(FakeCyborg(profiles))
    config = OpenStackConfig(
        auth_type="noauth",
        placement_endpoint="http://127.0.0.1:9",
        cyborg=True,
        cyborg_endpoint=url or served.url,
    )
    engine = create_engine("sqlite://")
    metadata.create_all(engine)
    return OpenStackPlatform(Session(engine), config, build_clients(config)), served


def test_cyborg_profiles_come_first_then_gpumode_own() -> None:
    platform, served = platform_with_cyborg(
        [
            {
                "name": "vdi-small",
                "uuid": "u1",
                "description": "users' layout",
                "groups": [
                    {"resources:VGPU": "1", "accel:vgpu_type": "nvidia-222", "accel:vgpus_per_gpu": "4"}
                ],
            },
            {"name": "fpga", "uuid": "u2", "groups": [{"resources:FPGA": "1"}]},
        ]
    )
    try:
        platform.put_profile(VgpuProfile("vdi-small", "nvidia-230", 1))
        platform.put_profile(VgpuProfile("own", "nvidia-223", 2))
        assert platform.list_profiles() == [
            VgpuProfile("own", "nvidia-223", 2),
            VgpuProfile("vdi-small", "nvidia-222", 4, "users' layout"),
        ]
    finally:
        served.stop()


def test_bad_or_unreachable_cyborg_is_an_error_not_a_fallback() -> None:
    bad = [
        {
            "name": "x",
            "groups": [{"resources:VGPU": "1", "accel:vgpu_type": "nvidia-1", "accel:vgpus_per_gpu": "two"}],
        }
    ]
    platform, served = platform_with_cyborg(bad)
    try:
        with pytest.raises(
            OpenStackError, match="'x': accel:vgpus_per_gpu must be a whole number, not 'two'"
        ):
            platform.list_profiles()
    finally:
        served.stop()
    platform, served = platform_with_cyborg([], url="http://127.0.0.1:9")
    served.stop()
    with pytest.raises(
        OpenStackError,
        match="cannot read vGPU layouts from Cyborg: cyborg GET /v2/device_profiles: unreachable",
    ):
        platform.list_profiles()


def test_server_settings_select_openstack(tmp_path: Path) -> None:
    cfg = tmp_path / "server.toml"
    cfg.write_text(
        '[server]\ncloud = "openstack"\n\n[openstack]\nauth_type = "noauth"\n'
        'placement_endpoint = "http://placement:8778"\npci_in_placement = true\n'
    )
    settings = load_settings(cfg)
    assert settings.cloud == "openstack" and settings.openstack is not None
    assert settings.openstack.pci_in_placement and settings.openstack.restart_command[-1] == "nova-compute"
    from gpumode.server.state import select_platform

    assert select_platform(settings).__name__ == "make"  # the OpenStack factory, not EmbeddedPlatform


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("", "cloud = openstack needs an \\[openstack\\] section"),
        ('[openstack]\nauth_type = "noauth"\n', "auth_type noauth needs placement_endpoint"),
        ('[openstack]\nauth_url = "http://k"\n', "auth_type password needs username, password, project_name"),
        (
            '[openstack]\nauth_type = "noauth"\nplacement_endpoint = "x"\nrestart_command = []\n',
            "restart_command",
        ),
        ('[openstack]\nauth_type = "token"\n', "auth_type"),
    ],
)
def test_bad_openstack_settings_are_named(tmp_path: Path, section: str, message: str) -> None:
    cfg = tmp_path / "server.toml"
    cfg.write_text(f'[server]\ncloud = "openstack"\n\n{section}')
    with pytest.raises(SettingsError, match=message):
        load_settings(cfg)


def test_config_is_frozen() -> None:
    config = OpenStackConfig(auth_type="noauth", placement_endpoint="http://p")
    with pytest.raises(ValidationError):
        config.inventory_timeout_s = 1  # type: ignore[misc]
