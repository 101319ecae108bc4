"""Whitelist, compatibility, request validation: each refusal has a code, names the problem, lists choices."""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_builders import B200, CATALOG, L40S, T4, HostBuilder, plan, request

from gpumode.domain import Mode, SwitchRequest
from gpumode.modes.policy import (
    RequestError,
    load_whitelist,
    parse_mode,
    parse_vm_policy,
    parse_whitelist,
    resolve_request,
    vgpu_offer,
)
from gpumode.yamlfile import ConfigError

G1, G2 = "0000:17:00.0", "0000:3a:00.0"


def whitelist(**over: object):  # type: ignore[no-untyped-def]
    data = {"version": "v1", "platform": {"modes": ["accel", "vgpu", "passthrough"]}, **over}
    return parse_whitelist(data, "test.yaml")


def refusal(snap, req, **kw) -> RequestError:  # type: ignore[no-untyped-def]
    with pytest.raises(RequestError) as err:
        plan(snap, req, **kw)
    return err.value


def t4_host():  # type: ignore[no-untyped-def]
    return HostBuilder("vdi-07").gpu(G1, T4).gpu(G2, T4).build()


def test_parse_mode_and_vm_policy() -> None:
    assert parse_mode(" VGPU ") is Mode.VGPU
    with pytest.raises(RequestError) as err:
        parse_mode("container")
    assert err.value.code == "unknown_mode" and err.value.choices == ("accel", "vgpu", "passthrough")
    assert "'container'" in str(err.value)
    with pytest.raises(RequestError) as err:
        parse_vm_policy("kill")
    assert err.value.code == "unknown_vm_policy" and "refuse" in err.value.choices


def test_mode_none_cannot_be_requested() -> None:
    e = refusal(t4_host(), request(Mode.NONE))
    assert e.code == "mode_not_allowed" and "none" in e.message


def test_unknown_gpu_lists_the_host_gpus() -> None:
    e = refusal(t4_host(), request(Mode.ACCEL, "0000:99:00.0"))
    assert e.code == "unknown_gpu" and e.choices == (G1, G2)


def test_a_malformed_address_is_bad_address_not_unknown_gpu() -> None:
    e = refusal(t4_host(), request(Mode.ACCEL, "zz:00.0"))
    assert e.code == "bad_address" and "not a PCI address" in e.message


def test_short_addresses_are_accepted() -> None:
    resolved = resolve_request(t4_host(), request(Mode.ACCEL, "17:00.0"), CATALOG, load_whitelist())
    assert [g.address for g in resolved.gpus] == [G1]


def test_mode_disabled_platform_wide() -> None:
    wl = parse_whitelist({"version": "v1", "platform": {"modes": ["accel"]}}, "wl.yaml")
    e = refusal(t4_host(), request(Mode.PASSTHROUGH), whitelist=wl)
    assert e.code == "mode_not_allowed" and "platform-wide (wl.yaml)" in e.message and e.choices == ("accel",)


def test_host_group_narrows_by_hostname_pattern_or_by_name() -> None:
    wl = whitelist(
        host_groups=[
            {"name": "vdi", "hosts": ["vdi-*"], "modes": ["vgpu"]},
            {"name": "batch", "modes": ["accel"]},
        ]
    )
    e = refusal(t4_host(), request(Mode.ACCEL), whitelist=wl)
    assert e.code == "mode_not_allowed" and "host group 'vdi'" in e.message and e.choices == ("vgpu",)
    assert plan(t4_host(), request(Mode.ACCEL), whitelist=wl, host_group="batch").steps
    e = refusal(t4_host(), request(Mode.ACCEL), whitelist=wl, host_group="nope")
    assert e.code == "unknown_host_group" and e.choices == ("vdi", "batch")


def test_gpu_model_rule_and_licence() -> None:
    wl = whitelist(gpu_models={"1eb8": {"modes": ["accel", "passthrough"]}})
    e = refusal(t4_host(), request(Mode.VGPU, vgpu_type="T4-1Q"), whitelist=wl)
    assert "GPU model 10de:1eb8" in e.message and e.choices == ("accel", "passthrough")
    e = refusal(
        t4_host(), request(Mode.VGPU, vgpu_type="T4-1Q"), whitelist=whitelist(licenses={"vgpu": False})
    )
    assert e.code == "mode_not_allowed" and "licence" in e.message


def test_hardware_limits_are_mode_not_allowed() -> None:
    snap = HostBuilder().gpu(G1, B200).gpu(G2, T4, iommu=False).build()
    e = refusal(snap, request(Mode.VGPU, G1, vgpu_type="x"))
    assert "offers no vGPU types" in e.message and e.choices == ("accel", "passthrough")
    e = refusal(snap, request(Mode.PASSTHROUGH, G2))
    assert "no IOMMU group" in e.message and "passthrough" not in e.choices


def test_vgpu_type_and_count_validation() -> None:
    snap = t4_host()
    e = refusal(snap, request(Mode.VGPU, G1))
    assert e.code == "vgpu_type_required" and "GRID T4-1Q" in e.choices
    e = refusal(snap, request(Mode.VGPU, G1, vgpu_type="T4-3Q"))
    assert e.code == "vgpu_type_not_offered" and "'T4-3Q'" in e.message and "GRID T4-4Q" in e.choices
    e = refusal(snap, request(Mode.VGPU, G1, vgpu_type="nvidia-232", vgpu_count=5))
    assert e.code == "vgpu_count_exceeds" and "at most 4" in e.message and e.choices == ("1", "2", "3", "4")


def test_vf_count_caps_vgpus_on_sriov_gpus() -> None:
    snap = HostBuilder().gpu(G1, L40S, total_vfs=32).build()
    e = refusal(snap, request(Mode.VGPU, vgpu_type="NVIDIA L40S-1Q", vgpu_count=33))
    assert e.code == "vgpu_count_exceeds" and "at most 32" in e.message


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (SwitchRequest(Mode.ACCEL, vgpu_type="T4-1Q"), "only apply to mode vgpu"),
        (SwitchRequest(Mode.VGPU, vgpu_type="T4-1Q", vgpu_count=0), "at least 1"),
        (SwitchRequest(Mode.ACCEL, passthrough_alias="t4"), "only applies to mode passthrough"),
    ],
)
def test_options_for_the_wrong_mode_are_refused(req: SwitchRequest, needle: str) -> None:
    e = refusal(t4_host(), req)
    assert e.code == "invalid_option" and needle in e.message


def test_compatibility_allows_passthrough_next_to_either_driver() -> None:
    accel = HostBuilder().gpu(G1, T4, mode=Mode.ACCEL).gpu(G2, T4, mode=Mode.ACCEL).datacenter().build()
    assert plan(accel, request(Mode.PASSTHROUGH, G2)).steps
    vgpu = HostBuilder().gpu(G1, T4, mode=Mode.VGPU).gpu(G2, T4, mode=Mode.VGPU).vgpu_manager().build()
    assert plan(vgpu, request(Mode.PASSTHROUGH, G2)).steps
    e = refusal(vgpu, request(Mode.ACCEL, G2))
    assert e.code == "incompatible_modes" and G1 in e.message and e.choices == ("vgpu", "passthrough")


def test_vgpu_offer_prefers_the_host_sysfs_over_the_catalog() -> None:
    snap = (
        HostBuilder()
        .gpu(
            G1,
            T4,
            mode=Mode.VGPU,
            pf_mdev_types=((230, "GRID T4-1Q", 16), (999, "GRID T4-X", 3)),
            pf_mdevs=(("u-1", 999),),
        )
        .vgpu_manager()
        .build()
    )
    offer = vgpu_offer(snap, snap.gpus[0], CATALOG)
    assert offer is not None and offer.source == "host" and offer.parent == "pf"
    by_id = {t.id: t for t in offer.types}
    assert set(by_id) == {230, 999}
    assert by_id[230].max_instances == 16 and by_id[999].max_instances == 4  # 3 free + 1 held
    bare = HostBuilder().gpu(G1, T4).build()
    catalog_offer = vgpu_offer(bare, bare.gpus[0], CATALOG)
    assert catalog_offer is not None and catalog_offer.source == "catalog" and len(catalog_offer.types) == 17


def test_whitelist_file_errors_name_file_path_and_problem(tmp_path: Path) -> None:
    f = tmp_path / "wl.yaml"
    f.write_text("version: v1\nplatform:\n  modes: [accel, gpu]\n")
    with pytest.raises(ConfigError) as err:
        load_whitelist(f)
    assert str(f) in str(err.value) and "platform.modes[1]" in str(err.value) and "'gpu'" in str(err.value)
    f.write_text("version: v1\nplatform: {modes: [accel]}\nhost_group: []\n")
    with pytest.raises(ConfigError, match="unknown key 'host_group'"):
        load_whitelist(f)
    f.write_text("version: v1\nplatform: {modes: [accel]}\ngpu_models: {1eb8x: {modes: [accel]}}\n")
    with pytest.raises(ConfigError, match=r"gpu_models\.1eb8x: GPU model keys"):
        load_whitelist(f)
    with pytest.raises(ConfigError, match="cannot read"):
        load_whitelist(tmp_path / "missing.yaml")
    f.write_text(
        "version: v1\nplatform: {modes: [accel]}\nhost_groups: [{name: a, modes: []}, {name: a, modes: []}]\n"
    )
    with pytest.raises(ConfigError, match="duplicate host group 'a'"):
        load_whitelist(f)
    f.write_text("version: v1\nplatform: {modes: [passthrough]}\n")
    assert load_whitelist(f).platform == frozenset({Mode.PASSTHROUGH})


# --- hosts the planner must not act on ---------------------------------------------------------------------

AUDIO = "0000:17:00.1"


def _host_with_audio():  # type: ignore[no-untyped-def]
    return HostBuilder().gpu(G1, L40S, mode=Mode.ACCEL, companions=((AUDIO, 0x040300, None),)).datacenter()


def test_a_host_in_mode_unknown_is_not_planned() -> None:
    snap = _host_with_audio().build()
    snap.gpus[0].mode = Mode.UNKNOWN
    for req in (request(Mode.PASSTHROUGH), request(Mode.ACCEL)):
        e = refusal(snap, req)
        assert e.code == "host_state_unknown" and G1 in e.message and "mode unknown" in e.message


def test_a_removed_companion_is_refused_naming_it() -> None:
    snap = _host_with_audio().build()
    snap.functions = [f for f in snap.functions if f.address != AUDIO]  # gone, the GPU still lists it
    e = refusal(snap, request(Mode.PASSTHROUGH))
    assert e.code == "inconsistent_hardware" and f"companion {AUDIO} is gone" in e.message


def test_a_phantom_function_is_refused_naming_it() -> None:
    snap = _host_with_audio().build()
    fn = snap.function(AUDIO)
    assert fn is not None
    fn.vendor = fn.device = fn.class_code = -1
    e = refusal(snap, request(Mode.PASSTHROUGH))
    assert e.code == "inconsistent_hardware" and AUDIO in e.message and "phantom" in e.message


def test_a_dangling_link_of_a_companion_is_refused() -> None:
    snap = _host_with_audio().build()
    snap.problems.append(
        f"sys/bus/pci/devices/{AUDIO}/iommu_group: dangling link (no sys/kernel/iommu_groups/10)"
    )
    e = refusal(snap, request(Mode.PASSTHROUGH))
    assert e.code == "inconsistent_hardware" and AUDIO in e.message and "dangling link" in e.message
    # the same problem on a function the switch does not touch refuses nothing
    snap.problems[-1] = "sys/bus/pci/devices/0000:99:00.0/iommu_group: dangling link (no ...)"
    assert plan(snap, request(Mode.PASSTHROUGH)).steps


def _console_host():  # type: ignore[no-untyped-def]
    snap = _host_with_audio().build()
    fn = snap.function(G1)
    assert fn is not None
    fn.boot_vga = True
    return snap


def test_passthrough_of_the_boot_display_needs_allow_boot_vga() -> None:
    e = refusal(_console_host(), request(Mode.PASSTHROUGH))
    assert e.code == "boot_vga" and G1 in e.message and "console goes dark" in e.message
    assert "--allow-boot-vga" in e.message
    allowed = request(Mode.PASSTHROUGH)
    allowed.allow_boot_vga = True
    p = plan(_console_host(), allowed)
    assert any("console goes dark" in n and G1 in n for n in p.impact.notes)
    # other modes never touch the console's driver binding this way
    assert not plan(_console_host(), request(Mode.ACCEL)).impact.notes
