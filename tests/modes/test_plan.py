"""The planner: every transition between none / accel / vgpu / passthrough, mixed hosts, VM policies."""

from __future__ import annotations

import json

import pytest
from plan_builders import (
    A16,
    CLASS_BRIDGE,
    CLASS_HDA,
    H100,
    L40S,
    T4,
    HostBuilder,
    actions,
    plan,
    request,
    steps_of,
    vf_address,
    vm,
)

from gpumode.cloud.openstack.delivery import predict
from gpumode.cloud.openstack.http import OpenStackError
from gpumode.cloud.openstack.novaconf import render_dropin
from gpumode.domain import HostSnapshot, Mode, VmPolicy
from gpumode.modes.plan import host_steps
from gpumode.modes.policy import RequestError

G1, G2, G3 = "0000:17:00.0", "0000:3a:00.0", "0000:98:00.0"
HDA = "0000:3a:00.1"


def t4_bare() -> HostBuilder:
    return HostBuilder("t4-edge").gpu(G1, T4).gpu(G2, T4)


def hgx(**kw: bool) -> HostBuilder:
    return (
        HostBuilder("hgx")
        .gpu(G1, H100, mode=Mode.ACCEL, total_vfs=32)
        .gpu(G2, H100, mode=Mode.ACCEL, total_vfs=32)
        .datacenter(**kw)
    )


def l40s_vgpu() -> HostBuilder:
    """Two L40S in vgpu mode: G1 carries two 4Q vGPUs on VFs 0 and 1, G2 none yet."""
    return (
        HostBuilder("l40s")
        .gpu(G1, L40S, mode=Mode.VGPU, total_vfs=32, num_vfs=4, vendor_types={0: 1150, 1: 1150})
        .gpu(G2, L40S, mode=Mode.VGPU, total_vfs=32, num_vfs=4, vendor_types={})
        .vgpu_manager()
    )


# --- from no driver -----------------------------------------------------------------------------------------


def test_none_to_accel_installs_the_datacenter_driver_directly() -> None:
    p = plan(t4_bare().build(), request(Mode.ACCEL))
    assert actions(p) == [
        "driver.install",
        *["module.load"] * 3,
        "bind.host",
        "bind.host",
        "service.start",
        "command.run",
    ]
    install = steps_of(p, "driver.install")[0]
    assert install.target == "datacenter"
    assert install.params["packages"] == ["nvidia-driver-550-server", "nvidia-container-toolkit"]
    assert install.params["installer"] == "apt"
    assert [s.target for s in steps_of(p, "module.load")] == ["nvidia", "nvidia_uvm", "nvidia_modeset"]
    assert steps_of(p, "service.start")[0].target == "nvidia-persistenced.service"
    assert steps_of(p, "command.run")[0].params["argv"] == [
        "nvidia-ctk",
        "runtime",
        "configure",
        "--runtime=containerd",
    ]
    assert steps_of(p, "bind.host")[0].params == {"drivers": {G1: "nvidia"}}
    assert p.impact.driver_change and p.impact.packages_installed == install.params["packages"]
    assert p.impact.gpus == {G1: (Mode.NONE, Mode.ACCEL), G2: (Mode.NONE, Mode.ACCEL)}
    assert not p.impact.packages_removed and not p.impact.vms_stopped


def test_none_to_accel_with_nvswitches_adds_fabric_manager() -> None:
    snap = t4_bare().build()
    snap.nvswitches = ["0000:05:00.0"]
    p = plan(snap, request(Mode.ACCEL))
    assert "nvidia-fabricmanager-550" in steps_of(p, "driver.install")[0].params["packages"]
    assert [s.target for s in steps_of(p, "service.start")] == [
        "nvidia-persistenced.service",
        "nvidia-fabricmanager.service",
    ]


def test_none_to_vgpu_on_turing_creates_mdevs_on_the_pf() -> None:
    p = plan(t4_bare().build(), request(Mode.VGPU, G1, G2, vgpu_type="T4-4Q"))
    assert actions(p) == [
        "driver.install",
        "module.load",
        "module.load",
        "bind.host",
        "bind.host",
        "service.start",
        "service.start",
        # the types came from the catalog: each GPU checks them on the host before it creates any
        "vgpu.resolve",
        *["vgpu.create"] * 4,
        "vgpu.resolve",
        *["vgpu.create"] * 4,
    ]
    creates = steps_of(p, "vgpu.create")
    assert creates[0].target == G1
    assert creates[0].params["interface"] == "mdev" and creates[0].params["vf_index"] is None
    assert creates[0].params["type_id"] == "nvidia-232" and creates[0].params["name"] == "GRID T4-4Q"
    assert len({s.params["uuid"] for s in creates}) == 8  # T4-4Q: 4 per GPU, unique UUIDs
    assert not steps_of(p, "sriov.enable")
    assert steps_of(p, "driver.install")[0].params["packages"] == ["nvidia-vgpu-ubuntu-550"]


def test_none_to_passthrough_leaves_the_driver_alone() -> None:
    snap = (
        HostBuilder()
        .gpu(
            G2, T4, companions=((HDA, CLASS_HDA, "snd_hda_intel"), ("0000:39:00.0", CLASS_BRIDGE, "pcieport"))
        )
        .build()
    )
    p = plan(snap, request(Mode.PASSTHROUGH, G2))
    assert actions(p) == ["module.load", "bind.vfio"]
    assert steps_of(p, "module.load")[0].target == "vfio_pci"
    assert steps_of(p, "bind.vfio")[0].params == {"functions": [G2, HDA], "persist": True}  # bridge left out
    assert not p.impact.driver_change


# --- accel <-> vgpu -----------------------------------------------------------------------------------------


def test_accel_to_vgpu_tears_down_datacenter_and_carves_vfs() -> None:
    snap = hgx(nvswitch=True, drm=True).build()
    p = plan(snap, request(Mode.VGPU, vgpu_type="NVIDIA H100XM-20C", vgpu_count=2))
    assert actions(p) == [
        "service.stop",
        "service.stop",
        *["module.unload"] * 4,
        "driver.remove",
        "driver.install",
        "module.load",
        "module.load",
        "bind.host",
        "bind.host",
        "sriov.enable",
        "sriov.enable",  # before nvidia-vgpu-mgr opens the GPUs
        "service.start",
        "service.start",
        *["vgpu.resolve", "vgpu.create", "vgpu.create"] * 2,
    ]
    assert [s.target for s in steps_of(p, "service.stop")] == [
        "nvidia-fabricmanager.service",
        "nvidia-persistenced.service",
    ]
    assert [s.target for s in steps_of(p, "module.unload")] == [
        "nvidia_drm",
        "nvidia_modeset",
        "nvidia_uvm",
        "nvidia",
    ]
    remove = steps_of(p, "driver.remove")[0]
    assert remove.params["packages"] == [
        "nvidia-driver-550-server",
        "nvidia-fabricmanager-550",
    ]  # toolkit stays
    enable = steps_of(p, "sriov.enable")[0]
    assert enable.params == {
        "num_vfs": 32,
        "argv": ["/usr/lib/nvidia/sriov-manage", "-e", G1],
        "undo_argv": ["/usr/lib/nvidia/sriov-manage", "-d", G1],
    }
    create = steps_of(p, "vgpu.create")[1]
    assert create.params == {"interface": "vendor", "vf_index": 1, "type": 1039, "name": "NVIDIA H100XM-20C"}
    assert p.impact.modules_unloaded == ["nvidia_drm", "nvidia_modeset", "nvidia_uvm", "nvidia"]
    assert p.impact.modules_loaded == ["nvidia", "nvidia_vgpu_vfio"]
    assert p.impact.driver_change and not p.impact.reboot_required


def a16_accel(*, layout_known: bool = True) -> HostSnapshot:
    """An A16 GPU on the data-center driver, VFs off (they exist only once the vGPU manager enables them)."""
    snap = HostBuilder("a16").gpu(G2, A16, mode=Mode.ACCEL, total_vfs=16).datacenter().build()
    pf = snap.function(G2)
    assert pf is not None and pf.sriov is not None and pf.sriov.vfs == []
    if not layout_known:  # as an agent older than sriov_offset/sriov_stride in the snapshot reports it
        pf.sriov.offset = pf.sriov.stride = None
    return snap


def test_accel_to_vgpu_on_an_a16_names_the_vfs_before_they_exist() -> None:
    """Ampere vGPUs are mdevs on VFs that ``sriov.enable`` makes: the plan (and nova's drop-in, predicted from
    it) names them by where the kernel will put them."""
    snap = a16_accel()
    p = plan(snap, request(Mode.VGPU, vgpu_type="NVIDIA A16-4Q", vgpu_count=2))
    assert actions(p)[-6:] == [
        "sriov.enable",
        "service.start",
        "service.start",
        "vgpu.resolve",
        "vgpu.create",
        "vgpu.create",
    ]
    assert steps_of(p, "sriov.enable")[0].params["num_vfs"] == 16
    vf0, vf1 = vf_address(G2, 0), vf_address(G2, 1)
    assert (vf0, vf1) == ("0000:3a:00.4", "0000:3a:00.5")
    creates = steps_of(p, "vgpu.create")
    assert [(s.params["vf_index"], s.params["type_id"]) for s in creates] == [
        (0, "nvidia-713"),
        (1, "nvidia-713"),
    ]
    assert [s.description for s in creates] == [
        f"create a NVIDIA A16-4Q vGPU on VF 0 ({vf0}) of {G2}",
        f"create a NVIDIA A16-4Q vGPU on VF 1 ({vf1}) of {G2}",
    ]
    after = predict(p, snap)
    gpu = after.gpu(G2)
    assert gpu is not None and gpu.vfs == [vf_address(G2, n) for n in range(16)]
    assert render_dropin(after) == (
        "# Written by gpumode for the GPUs' current modes; edits are overwritten at the next switch.\n\n"
        "[devices]\nenabled_mdev_types = nvidia-713\n\n"
        f"[mdev_nvidia-713]\ndevice_addresses = {vf0},{vf1}\n"
    )


def test_accel_to_vgpu_on_an_a16_from_an_older_agent_plans_but_cannot_configure_nova() -> None:
    """Without offset and stride the host still finds ``virtfn<N>`` when the step runs, but nova's drop-in
    cannot be written beforehand: refused with the reason, not a wrong file."""
    snap = a16_accel(layout_known=False)
    p = plan(snap, request(Mode.VGPU, vgpu_type="NVIDIA A16-4Q", vgpu_count=2))
    assert steps_of(p, "vgpu.create")[0].description == f"create a NVIDIA A16-4Q vGPU on VF 0 of {G2}"
    with pytest.raises(OpenStackError, match=rf"GPU {G2}: .*does not give its sriov_offset and sriov_stride"):
        predict(p, snap)


def test_vgpu_to_accel_reclaims_vgpus_held_by_vms_first() -> None:
    snap = l40s_vgpu().build()
    vf0, vf1 = vf_address(G1, 0), vf_address(G1, 1)
    vms = [vm("desk-1", f"pci:{vf0}"), vm("desk-2", f"pci:{vf1}", running=False), vm("web", running=True)]
    p = plan(snap, request(Mode.ACCEL), vms)
    acts = actions(p)
    assert acts[:3] == ["vm.shutdown", "vm.detach_device", "vm.detach_device"]
    assert [s.target for s in steps_of(p, "vm.shutdown")] == ["desk-1"]  # policy gpu: not "web", not stopped
    assert [(s.target, s.params["id"]) for s in steps_of(p, "vm.detach_device")] == [
        ("desk-1", vf0),
        ("desk-2", vf1),
    ]
    removes = steps_of(p, "vgpu.remove")
    assert [(s.target, s.params) for s in removes] == [
        (vf0, {"interface": "vendor", "type": 1150}),
        (vf1, {"interface": "vendor", "type": 1150}),
    ]
    assert [s.target for s in steps_of(p, "sriov.disable")] == [G1, G2]
    order = [
        a
        for a in acts
        if a
        in (
            "vgpu.remove",
            "sriov.disable",
            "service.stop",
            "module.unload",
            "driver.remove",
            "driver.install",
            "module.load",
        )
    ]
    assert order == [
        "vgpu.remove",
        "vgpu.remove",
        "service.stop",  # vgpu-mgr holds the GPUs: sriov-manage needs their unbindLock
        "service.stop",
        "sriov.disable",
        "sriov.disable",
        "module.unload",
        "module.unload",
        "driver.remove",
        "driver.install",
        "module.load",
        "module.load",
        "module.load",
    ]
    assert [s.target for s in steps_of(p, "service.stop")] == [
        "nvidia-vgpu-mgr.service",
        "nvidia-vgpud.service",
    ]
    assert p.impact.vms_stopped == ["desk-1"]
    assert p.impact.devices_detached == [f"desk-1: pci:{vf0}", f"desk-2: pci:{vf1}"]
    assert p.impact.vgpus_reclaimed == [vf0, vf1]
    assert p.impact.packages_removed == ["nvidia-vgpu-ubuntu-550"]


def test_mdev_vgpus_are_removed_by_uuid() -> None:
    snap = (
        HostBuilder()
        .gpu(
            G1,
            A16,
            mode=Mode.VGPU,
            total_vfs=16,
            num_vfs=2,
            vf_mdevs={0: ("aaaa-1", 713), 1: ("aaaa-2", 713)},
        )
        .vgpu_manager()
        .build()
    )
    p = plan(snap, request(Mode.ACCEL), [vm("vdi", "mdev:aaaa-2")])
    removes = steps_of(p, "vgpu.remove")
    assert [(s.target, s.params["uuid"], s.params["type_id"]) for s in removes] == [
        (vf_address(G1, 0), "aaaa-1", "nvidia-713"),
        (vf_address(G1, 1), "aaaa-2", "nvidia-713"),
    ]
    assert [(s.target, s.params) for s in steps_of(p, "vm.detach_device")] == [
        ("vdi", {"kind": "mdev", "id": "aaaa-2"})
    ]


# --- passthrough --------------------------------------------------------------------------------------------


def test_accel_to_passthrough_moves_one_gpu_and_leaves_the_driver() -> None:
    snap = hgx().gpu(G3, H100, mode=Mode.ACCEL).build()
    p = plan(snap, request(Mode.PASSTHROUGH, G3))
    assert actions(p) == ["service.stop", "module.load", "gpu.release", "bind.vfio", "service.start"]
    assert steps_of(p, "gpu.release")[0].params == {"driver": "nvidia"}
    assert p.impact.gpus == {G3: (Mode.ACCEL, Mode.PASSTHROUGH)}
    assert not p.impact.driver_change and not p.impact.modules_unloaded
    cards = steps_of(p, "cloud.register_cards")[0].params["cards"]
    assert cards == [
        {
            "gpu": G3,
            "mode": "passthrough",
            "model": "10de:2330",
            "vgpu_type": None,
            "vgpu_count": None,
            "alias": "h100",
        }
    ]


def test_vgpu_to_passthrough_on_one_gpu_reclaims_it_and_keeps_the_others() -> None:
    snap = l40s_vgpu().build()
    vf0 = vf_address(G1, 0)
    p = plan(snap, request(Mode.PASSTHROUGH, G1, passthrough_alias="l40s-big"), [vm("desk-1", f"pci:{vf0}")])
    assert actions(p) == [
        "vm.shutdown",
        "vm.detach_device",
        "vgpu.remove",
        "vgpu.remove",
        "service.stop",
        "service.stop",
        "sriov.disable",
        "module.load",
        "gpu.release",
        "bind.vfio",
        "service.start",
        "service.start",
    ]
    assert all(s.target != G2 for s in host_steps(p))
    assert steps_of(p, "cloud.register_cards")[0].params["cards"][0]["alias"] == "l40s-big"


def test_passthrough_to_accel_detaches_the_gpu_from_its_vm_and_binds_nvidia() -> None:
    snap = (
        hgx()
        .gpu(G3, H100, mode=Mode.PASSTHROUGH, companions=(("0000:98:00.1", CLASS_HDA, "vfio-pci"),))
        .module("vfio_pci")
        .build()
    )
    vms = [vm("train", f"pci:{G3}", "pci:0000:98:00.1")]
    p = plan(snap, request(Mode.ACCEL, G3), vms)
    assert actions(p) == ["vm.shutdown", "vm.detach_device", "vm.detach_device", "bind.host"]
    assert steps_of(p, "bind.host")[0].params == {"drivers": {G3: "nvidia", "0000:98:00.1": None}}
    assert p.impact.gpus == {G3: (Mode.PASSTHROUGH, Mode.ACCEL)}


def test_passthrough_to_vgpu_installs_the_vgpu_manager_when_the_host_has_none() -> None:
    snap = HostBuilder().gpu(G1, L40S, mode=Mode.PASSTHROUGH, total_vfs=32).module("vfio_pci").build()
    p = plan(snap, request(Mode.VGPU, vgpu_type="L40S-24Q"))
    assert actions(p) == [
        "driver.install",
        "module.load",
        "module.load",
        "bind.host",
        "sriov.enable",
        "service.start",
        "service.start",
        "vgpu.resolve",
        "vgpu.create",
        "vgpu.create",
    ]


def test_passthrough_with_a_companion_left_on_a_host_driver_is_repaired() -> None:
    snap = HostBuilder().gpu(G2, T4, mode=Mode.PASSTHROUGH, companions=((HDA, CLASS_HDA, "snd_hda_intel"),))
    snap.module("vfio_pci")
    p = plan(snap.build(), request(Mode.PASSTHROUGH))
    assert actions(p) == ["bind.vfio"]
    assert not p.impact.vms_stopped


# --- mixed hosts and compatibility --------------------------------------------------------------------------


def test_mixed_accel_host_cannot_move_some_gpus_to_vgpu() -> None:
    with pytest.raises(RequestError) as err:
        plan(hgx().build(), request(Mode.VGPU, G1, vgpu_type="NVIDIA H100XM-20C"))
    assert err.value.code == "incompatible_modes"
    assert G2 in err.value.message and set(err.value.choices) == {"accel", "passthrough"}


def test_vgpu_host_with_a_passthrough_gpu_switches_the_rest_to_accel() -> None:
    snap = l40s_vgpu().gpu(G3, L40S, mode=Mode.PASSTHROUGH).module("vfio_pci").build()
    p = plan(snap, request(Mode.ACCEL, G1, G2), [vm("pt", f"pci:{G3}")])
    assert p.impact.driver_change
    assert all(s.target != G3 for s in host_steps(p))
    assert not p.impact.vms_stopped  # the VM on the passthrough GPU is not touched


# --- idempotence, environment, determinism ------------------------------------------------------------------


def test_host_already_in_target_mode_has_no_host_steps() -> None:
    assert host_steps(plan(hgx(nvswitch=True).build(), request(Mode.ACCEL))) == []
    p = plan(l40s_vgpu().build(), request(Mode.VGPU, G1, vgpu_type="NVIDIA L40S-4Q", vgpu_count=2))
    assert host_steps(p) == []
    assert [s.action for s in p.steps] == ["cloud.register_cards", "cloud.deploy_env"]
    pt = HostBuilder().gpu(G1, T4, mode=Mode.PASSTHROUGH).module("vfio_pci").build()
    assert host_steps(plan(pt, request(Mode.PASSTHROUGH))) == []


def test_vgpu_without_options_keeps_the_current_layout() -> None:
    p = plan(l40s_vgpu().build(), request(Mode.VGPU, G1))
    assert host_steps(p) == []
    assert steps_of(p, "cloud.register_cards")[0].params["cards"][0]["vgpu_count"] == 2


def test_vgpu_relayout_replaces_the_vgpus() -> None:
    p = plan(l40s_vgpu().build(), request(Mode.VGPU, G1, vgpu_type="NVIDIA L40S-1Q", vgpu_count=3))
    assert actions(p) == ["vgpu.remove", "vgpu.remove", "vgpu.create", "vgpu.create", "vgpu.create"]
    assert [s.params["vf_index"] for s in steps_of(p, "vgpu.create")] == [0, 1, 2]


def test_stopped_service_and_unloaded_module_are_repaired_without_reinstall() -> None:
    snap = hgx().build()
    snap.nvidia.services["nvidia-persistenced.service"] = False
    snap.modules = [m for m in snap.modules if m.name != "nvidia_uvm"]
    p = plan(snap, request(Mode.ACCEL))
    assert actions(p) == ["module.load", "service.start"]
    assert not p.impact.driver_change


def test_a_permanent_module_needs_a_reboot() -> None:
    snap = hgx().build()
    snap.modules[0].users.append("[permanent]")
    p = plan(snap, request(Mode.VGPU, vgpu_type="NVIDIA H100XM-80C"))
    assert p.impact.reboot_required


def test_plans_are_deterministic_with_stable_ordered_ids() -> None:
    def make() -> str:
        snap = l40s_vgpu().build()
        vms = [vm("b", f"pci:{vf_address(G1, 1)}"), vm("a", f"pci:{vf_address(G1, 0)}")]
        return json.dumps(plan(snap, request(Mode.ACCEL), vms).to_dict(), sort_keys=True, default=str)

    assert make() == make()
    p = plan(l40s_vgpu().build(), request(Mode.ACCEL))
    ids = [s.id for s in p.steps]
    assert len(set(ids)) == len(ids)
    assert [int(i.split("-", 1)[0]) for i in ids] == list(range(1, len(ids) + 1))
    assert ids[0] == f"01-{p.steps[0].action}-{p.steps[0].target}"
    assert [s.where for s in p.steps[-2:]] == ["cloud", "cloud"]
    assert p.impact.estimated_seconds == pytest.approx(sum(s.estimate_s for s in p.steps))
    assert p.snapshot_fingerprint.startswith("sha256:")


def test_mdev_uuids_do_not_change_between_plans() -> None:
    def uuids() -> list[str]:
        p = plan(t4_bare().build(), request(Mode.VGPU, G1, vgpu_type="GRID T4-8Q"))
        return [s.params["uuid"] for s in steps_of(p, "vgpu.create")]

    assert uuids() == uuids() and len(uuids()) == 2


# --- VM policies --------------------------------------------------------------------------------------------


def test_policy_refuse_fails_when_a_vm_would_be_touched() -> None:
    snap = l40s_vgpu().build()
    with pytest.raises(RequestError) as err:
        plan(snap, request(Mode.ACCEL, policy=VmPolicy.REFUSE), [vm("desk-1", f"pci:{vf_address(G1, 0)}")])
    assert err.value.code == "vm_policy_refused" and "desk-1" in err.value.message
    assert set(err.value.choices) == {"all", "gpu"}


def test_policy_refuse_passes_when_no_vm_is_touched() -> None:
    p = plan(hgx().build(), request(Mode.PASSTHROUGH, G1, policy=VmPolicy.REFUSE), [vm("web")])
    assert not p.impact.vms_stopped


def test_policy_all_stops_every_running_vm_and_gpu_only_the_holders() -> None:
    snap = hgx().build()
    vms = [vm("web"), vm("db"), vm("off", running=False)]
    p_all = plan(snap, request(Mode.VGPU, vgpu_type="NVIDIA H100XM-80C", policy=VmPolicy.ALL), vms)
    assert p_all.impact.vms_stopped == ["db", "web"]
    assert actions(p_all)[:2] == ["vm.shutdown", "vm.shutdown"]
    assert steps_of(p_all, "vm.shutdown")[0].params == {"timeout_s": 120.0}
    p_gpu = plan(snap, request(Mode.VGPU, vgpu_type="NVIDIA H100XM-80C", policy=VmPolicy.GPU), vms)
    assert p_gpu.impact.vms_stopped == []


def test_policy_all_touches_nothing_when_nothing_changes() -> None:
    p = plan(hgx().build(), request(Mode.ACCEL, policy=VmPolicy.ALL), [vm("web")])
    assert host_steps(p) == []


def test_teardown_does_not_trust_unknown_service_or_package_state() -> None:
    """Discovery could not read systemd or dpkg: stop the units and remove the flavour's packages anyway."""
    snap = hgx().build()
    snap.nvidia.services = {}
    snap.nvidia.packages = []
    p = plan(snap, request(Mode.VGPU, vgpu_type="NVIDIA H100XM-80C"))
    assert [s.target for s in steps_of(p, "service.stop")] == ["nvidia-persistenced.service"]
    assert steps_of(p, "driver.remove")[0].params["packages"] == ["nvidia-driver-550-server"]


def test_vendor_relayout_offers_types_the_busy_vfs_no_longer_list() -> None:
    # the builder's VFs list only 1Q and 4Q as creatable; the catalog knows the L40S-48Q the re-layout allows
    p = plan(l40s_vgpu().build(), request(Mode.VGPU, G1, vgpu_type="NVIDIA L40S-48Q", vgpu_count=1))
    assert [s.params["type"] for s in steps_of(p, "vgpu.create")] == [1156]


def test_releasing_one_gpu_pauses_only_the_gpu_holding_units() -> None:
    p = plan(hgx(nvswitch=True).build(), request(Mode.PASSTHROUGH, G2))
    assert [(s.action, s.target) for s in host_steps(p) if s.action.startswith("service.")] == [
        ("service.stop", "nvidia-persistenced.service"),
        ("service.start", "nvidia-persistenced.service"),
    ]  # fabric manager holds the NVSwitches, not the GPUs: it keeps running
