"""holders.py and the deadlines of Host.write / Host.run, without a kernel: holders on an emulated host (its
kernel renders proc/<pid>/fd for each open handle), a FIFO for a write that really blocks, ``sleep`` for a
command past its timeout. The real kernel's blocking is checked in tests/kernel/."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures.mini import mini_host
from gpumode.emulated.spec import VmSpec
from gpumode.host import bind, driverops, holders
from gpumode.host.root import CommandTimeout, Host, WriteBlocked

GPU = "0000:10:00.0"  # mini_host's first GPU


@pytest.fixture
def held(tmp_path: Path) -> Host:
    """A passthrough GPU that a running VM holds open through VFIO."""
    return create_host(mini_host("passthrough", vms=[VmSpec("vm-a", hostdevs=(GPU,))]), tmp_path / "host")


def test_a_running_vm_is_named_as_the_holder(held: Host) -> None:
    found = holders.holders(held, holders.pci_device_files(held, GPU))
    assert [(h.command, h.path) for h in found] == [("qemu-system-x86 (VM vm-a)", "/dev/vfio/3")]
    assert found[0].pid > 0


def test_release_from_vfio_refuses_while_a_vm_holds_the_group(held: Host) -> None:
    named = r"in use: qemu-system-x86 \(VM vm-a\) \(pid \d+\) has /dev/vfio/3"
    with pytest.raises(bind.BindError, match=named):
        bind.release_from_vfio(held, GPU, {GPU: None})
    assert bind.current_driver(held, GPU) == "vfio-pci"
    assert bind.driver_override(held, GPU) == "vfio-pci"  # nothing was changed


def test_unloading_a_driver_whose_device_a_vm_holds_is_refused(held: Host) -> None:
    assert driverops.bound_devices(held, "vfio_pci") == [GPU]
    with pytest.raises(driverops.DriverOpError, match=r"cannot unload vfio_pci: 0000:10:00\.0 is in use"):
        driverops.unload_module(held, "vfio_pci")
    assert driverops.module_loaded(held, "vfio_pci")


def test_no_holder_once_the_vm_is_gone(tmp_path: Path) -> None:
    stopped = VmSpec("vm-a", running=False, hostdevs=(GPU,))
    host = create_host(mini_host("passthrough", vms=[stopped]), tmp_path / "host")
    assert holders.holders(host, holders.pci_device_files(host, GPU)) == []
    after = bind.release_from_vfio(host, GPU, {GPU: None})
    assert after[GPU] != "vfio-pci"


def test_a_write_that_blocks_fails_at_its_deadline_and_finishes_later(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for writing blocks until a reader comes, like an unbind waiting for a VM
    host = Host(tmp_path)
    with pytest.raises(WriteBlocked) as blocked:
        host.write(fifo, "1", deadline=0.2)
    assert blocked.value.pending.is_alive()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    blocked.value.pending.join(5)
    reader.join(5)
    assert got == [b"1"]


def test_blocking_write_names_the_device_when_it_times_out(tmp_path: Path) -> None:
    fifo = tmp_path / "unbind"
    os.mkfifo(fifo)
    host = Host(tmp_path)
    with pytest.raises(holders.DeviceHeld, match=r"0000:01:00.0: writing '0000:01:00.0' to unbind was still"):
        holders.blocking_write(host, fifo, "0000:01:00.0", what="0000:01:00.0", files=[], deadline=0.2)
    with open(fifo, "rb") as release:  # let the pending writer finish
        release.read()


def test_a_command_past_its_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    with pytest.raises(CommandTimeout) as timed_out:
        Host(tmp_path).run(["sleep", "30"], timeout=0.3)
    assert not timed_out.value.still_running
    assert "timed out after 0.3 s" in str(timed_out.value)
