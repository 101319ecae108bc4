"""VF addresses before the VFs exist (``domain.vf_addresses``), checked three ways: against the kernel's own
formula (``pci_iov_virtfn_bus``/``_devfn`` in ``drivers/pci/iov.c``), against a real card's ``virtfn`` links
quoted in the reference (an A10), and against the links the emulated kernel makes when ``sriov-manage -e``
enables the VFs of an A16 and of an L40S whose VFs run onto the next bus. Last, what they are for: nova's
drop-in, predicted before an A16 goes from accel to vgpu, is the one the switched host calls for."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from gpumode.cloud.openstack.delivery import predict
from gpumode.cloud.openstack.novaconf import render_dropin
from gpumode.domain import Mode, PciAddress, PciFunction, Sriov, SriovLayoutError, SwitchRequest, vf_addresses
from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures.mini import mini_host
from gpumode.emulated.fixtures.models import A16, L40S, models
from gpumode.emulated.fixtures.topology import CLASS_PCI_BRIDGE, Board
from gpumode.emulated.spec import HostSpec
from gpumode.host import driverops, vgpu
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.modes import engine

A16_GPU = "0000:5e:00.0"
L40S_GPU = "0000:86:00.0"
# 0xfc past devfn 00.0: VFs 0-3 are 86:1f.4-1f.7, VFs 4-7 carry into bus 0x87
L40S_WRAPPING = dataclasses.replace(L40S, sriov_total_vfs=8, vf_offset=0xFC, vf_stride=1)
A16_SMALL = dataclasses.replace(A16, sriov_total_vfs=4)


def kernel_formula(pf: str, offset: int, stride: int, vf_id: int) -> str:
    """``pci_iov_virtfn_bus`` and ``pci_iov_virtfn_devfn`` as iov.c writes them (bus and devfn apart)."""
    a = PciAddress.parse(pf)
    devfn = (a.device << 3) | a.function
    bus = a.bus + ((devfn + offset + stride * vf_id) >> 8)
    vf_devfn = (devfn + offset + stride * vf_id) & 0xFF
    return f"{a.domain:04x}:{bus:02x}:{vf_devfn >> 3:02x}.{vf_devfn & 7:x}"


@pytest.mark.parametrize(
    ("pf", "offset", "stride", "count"),
    [
        ("0000:41:00.0", 4, 1, 32),  # NVIDIA A10 / A16 / L40S
        ("0000:3b:00.0", 4, 1, 16),
        ("0001:c1:00.1", 0x80, 2, 64),  # a second PF, a stride of 2, another PCI domain
        ("0000:86:00.0", 0xFC, 1, 8),  # runs onto bus 0x87
        ("0000:fe:1f.0", 0x100, 1, 3),  # a whole bus further
    ],
)
def test_matches_the_kernel_formula(pf: str, offset: int, stride: int, count: int) -> None:
    expected = [kernel_formula(pf, offset, stride, n) for n in range(count)]
    assert vf_addresses(pf, offset, stride, count) == expected
    assert len(set(expected)) == count


def test_matches_a_real_a10s_virtfn_links() -> None:
    """The reference's A10: ``virtfn0 -> 41:00.4``, ``virtfn1 -> 41:00.5``, ``virtfn10 -> 41:01.6``,
    ``virtfn31 -> 41:04.3`` with offset 4, stride 1, 32 VFs."""
    vfs = vf_addresses("0000:41:00.0", 4, 1, 32)
    links = {0: "0000:41:00.4", 1: "0000:41:00.5", 10: "0000:41:01.6", 31: "0000:41:04.3"}
    assert {n: vfs[n] for n in links} == links


def test_a_vf_can_sit_on_the_next_bus() -> None:
    assert vf_addresses("0000:86:00.0", 0xFC, 1, 6)[3:] == ["0000:86:1f.7", "0000:87:00.0", "0000:87:00.1"]


@pytest.mark.parametrize(
    ("pf", "offset", "stride", "count", "message"),
    [
        ("0000:41:00.0", 0, 1, 4, r"^0000:41:00\.0: sriov_offset is 0: VF 0 would be the PF itself$"),
        ("0000:41:00.0", 4, 0, 2, r"sriov_stride is 0: its 2 VFs would share one address"),
        ("0000:ff:00.0", 4, 1, 256, r"VF 255 would be on bus 0x100, past bus 0xff: there is no room for 256"),
        ("0000:41:00.0", -4, 1, 4, r"sriov_offset -4 is not a 16-bit count"),
        ("0000:41:00.0", 4, 1, 0x10000, r"VF count 65536 is not a 16-bit count"),
    ],
)
def test_impossible_layouts_are_refused(pf: str, offset: int, stride: int, count: int, message: str) -> None:
    with pytest.raises(SriovLayoutError, match=message):
        vf_addresses(pf, offset, stride, count)


def test_one_vf_needs_no_stride_and_none_needs_nothing() -> None:
    assert vf_addresses("0000:41:00.0", 4, 0, 1) == ["0000:41:00.4"]
    assert vf_addresses("0000:41:00.0", 0, 0, 0) == []


def test_a_pf_says_what_it_cannot_tell() -> None:
    fn = PciFunction("0000:41:00.0", 0x10DE, 0x26B9, 0x10DE, 0x1851, 0x030200, 0xA1)
    with pytest.raises(SriovLayoutError, match="no SR-IOV capability"):
        fn.vf_addresses()
    fn.sriov = Sriov(total_vfs=4, num_vfs=0)  # as an older agent reports it: no offset, no stride
    with pytest.raises(SriovLayoutError, match="does not give its sriov_offset and sriov_stride"):
        fn.vf_addresses()
    fn.sriov = Sriov(total_vfs=4, num_vfs=0, offset=4, stride=1)
    assert fn.vf_addresses() == ["0000:41:00.4", "0000:41:00.5", "0000:41:00.6", "0000:41:00.7"]
    assert fn.vf_addresses(2) == ["0000:41:00.4", "0000:41:00.5"]
    with pytest.raises(SriovLayoutError, match="5 VFs asked for, but sriov_totalvfs is 4"):
        fn.vf_addresses(5)


# --- against the emulated kernel ----------------------------------------------------------------------------


def vgpu_host_spec() -> HostSpec:
    """An A16 and a wrapping L40S under the vGPU manager, their VFs not enabled yet."""
    board = Board()
    for bus, model in ((0x5D, A16_SMALL), (0x85, L40S_WRAPPING)):
        port = board.add(board.addr(bus, 1, 0), 0x8086, 0x352A, CLASS_PCI_BRIDGE, numa=0, driver="pcieport")
        board.gpu(board.addr(bus + 1, 0, 0), model, parent=port, numa=0, driver="nvidia")
    return HostSpec(
        name="vf-addresses",
        description="SR-IOV GPUs with VFs off",
        hostname="vf-addresses",
        devices=board.devices,
        gpu_models=models(A16_SMALL, L40S_WRAPPING),
        packages=["nvidia-vgpu-ubuntu-550"],
        modules=["nvidia", "nvidia_vgpu_vfio"],
        services=["nvidia-vgpud", "nvidia-vgpu-mgr"],
    )


def virtfn_links(host: Host, pf: str) -> list[str]:
    """Where the kernel's ``virtfn<N>`` links point, in N order, read without discovery."""
    path = host.path("sys/bus/pci/devices", pf)
    links = sorted((int(name[6:]), name) for name in os.listdir(path) if name.startswith("virtfn"))
    return [os.path.basename(os.readlink(path / name)) for _, name in links]


def test_the_addresses_known_before_are_the_vfs_the_kernel_makes(tmp_path: Path) -> None:
    host = create_host(vgpu_host_spec(), tmp_path / "host")
    before = discover(host)
    assert before.problems == []
    predicted = {}
    for pf, model in ((A16_GPU, A16_SMALL), (L40S_GPU, L40S_WRAPPING)):
        fn = before.function(pf)
        assert fn is not None and fn.sriov is not None and fn.sriov.num_vfs == 0
        assert (fn.sriov.offset, fn.sriov.stride) == (model.vf_offset, model.vf_stride)
        predicted[pf] = fn.vf_addresses()
        assert virtfn_links(host, pf) == []
    assert predicted[L40S_GPU][-1] == "0000:87:00.3"  # on the next bus

    driverops.stop_service(host, "nvidia-vgpu-mgr")  # sriov-manage rebinds the PF: nothing may hold it
    for pf in predicted:
        assert vgpu.enable_vfs(host, pf) == predicted[pf]
        assert virtfn_links(host, pf) == predicted[pf]
    after = discover(host)
    assert after.problems == []
    for pf, vfs in predicted.items():
        gpu = after.gpu(pf)
        assert gpu is not None and gpu.vfs == vfs
        assert all((f := after.function(vf)) is not None and f.physfn == pf for vf in vfs)


def test_nova_dropin_predicted_for_an_a16_going_accel_to_vgpu_is_the_one_after_the_switch(
    tmp_path: Path,
) -> None:
    """The whole way: plan on an A16 whose VFs do not exist, predict nova's drop-in (it names the VFs),
    switch, and render the drop-in from the host as discovery then sees it."""
    host = create_host(mini_host("accel", A16_SMALL), tmp_path / "host")
    before = discover(host)
    (gpu,) = before.gpus
    assert gpu.mode is Mode.ACCEL and gpu.vfs == []
    request = SwitchRequest(mode=Mode.VGPU, vgpu_type="NVIDIA A16-4Q", vgpu_count=2)
    predicted = render_dropin(predict(engine.plan(host, request), before))
    vfs = vf_addresses(gpu.address, A16.vf_offset, A16.vf_stride, 2)
    assert f"device_addresses = {','.join(vfs)}\n" in predicted
    result = engine.apply(host, request)
    assert result.ok, result
    assert render_dropin(discover(host)) == predicted
