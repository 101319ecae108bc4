"""The emulated kernel's caches are invisible: whatever sequence of operations ran, the files on disk are
exactly a from-scratch render of the saved state, in this process, after another process acted, and after a
process died between saving a state and updating the files."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import H100, HDA, L40S, L40S_VF0, NIC, T4, VGA, build, dev, make_spec
from gpumode.emulated import kernel as kernel_mod
from gpumode.emulated import state as state_mod
from gpumode.emulated import sysfs
from gpumode.emulated.kernel import EmulatedKernel
from gpumode.emulated.state import KernelState

KERNEL_DIRS = ("sys", "proc", "dev")
MODULES = ("vfio_pci", "nvidia", "nvidia_uvm", "nvidia_vgpu_vfio", "mlx5_core", "pci_stub", "pci_pf_stub")
HOLDERS = ("vm-a", "vm-b", "persistenced")


class Killed(BaseException):
    """The process dies here (not an OSError: nothing may catch it on the way out)."""


def full_render(state: KernelState) -> sysfs.Tree:
    with sysfs.caching(False):
        return sysfs.render(state)


def on_disk(root: Path) -> dict[str, sysfs.Node]:
    """The kernel's part of the directory, read back as render nodes."""
    nodes: dict[str, sysfs.Node] = {}
    for top in KERNEL_DIRS:
        if not (root / top).is_dir():
            continue
        nodes[top] = sysfs.DIR
        for dirpath, dirnames, filenames in os.walk(root / top):
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)
                if os.path.islink(full):
                    nodes[rel] = sysfs.Link(os.readlink(full))
                elif os.path.isdir(full):
                    nodes[rel] = sysfs.DIR
                else:
                    with open(full, "rb") as fh:
                        nodes[rel] = sysfs.File(fh.read(), os.stat(full).st_mode & 0o7777)
    return nodes


def assert_disk_is_fresh_render(k: EmulatedKernel) -> None:
    expected = full_render(k.snapshot()).nodes
    actual = on_disk(k.root)
    wrong = sorted(p for p in expected.keys() | actual.keys() if expected.get(p) != actual.get(p))
    assert not wrong, f"{len(wrong)} paths differ from a fresh render, e.g. {wrong[:5]}"


def random_operations(k: EmulatedKernel, rng: random.Random, count: int) -> Iterator[bool]:
    """Seeded random kernel operations, valid or not; yields whether each one succeeded."""
    for _ in range(count):
        st = k.snapshot()
        writable = sorted(full_render(st).writable)
        devices = sorted(st.devices)
        roll = rng.random()
        try:
            if roll < 0.10:
                k.load_module(rng.choice(MODULES))
            elif roll < 0.16:
                k.unload_module(rng.choice(MODULES))
            elif roll < 0.22:
                k.open_handle(rng.choice(HOLDERS), rng.choice(["nvidia", "vfio"]), rng.choice(devices))
            elif roll < 0.26:
                k.close_all(rng.choice(HOLDERS))
            elif roll < 0.27:
                k.reboot()
            elif roll < 0.29:
                k.inject_fault(rng.choice(writable), 5)
            else:
                path = rng.choice(writable)
                k.write(path, _value_for(path, rng, devices, sorted(st.drivers)))
        except OSError:
            yield False
        else:
            yield True


def _value_for(path: str, rng: random.Random, devices: list[str], drivers: list[str]) -> str:
    attr = path.rsplit("/", 1)[1]
    if attr in ("bind", "unbind", "drivers_probe"):
        return rng.choice(devices) + "\n"
    if attr == "driver_override":
        return rng.choice([*drivers, "\n", "vfio-pci\n"])
    if attr == "sriov_numvfs":
        return str(rng.randint(0, 4))
    if attr == "create":
        return str(uuid.UUID(int=rng.getrandbits(128)))
    if attr == "current_vgpu_type":
        return rng.choice(["0", "1150", "1151", "x"])
    if attr in ("new_id", "remove_id"):
        return rng.choice(["10de 2330", "15b3 101c", "8086 1901", "zz"])
    if attr == "numa_node":
        return rng.choice(["0", "1", "-1", "9"])
    return rng.choice(["1", "0", "1\n"])


@pytest.fixture(params=["datacenter", "vgpu"])
def kernel(request: pytest.FixtureRequest, tmp_path: Path) -> EmulatedKernel:
    flavour = request.param
    return build(tmp_path / "host", make_spec(flavour), flavour)


def test_tree_on_disk_is_a_fresh_render_after_random_operations(kernel: EmulatedKernel) -> None:
    rng = random.Random(1)
    succeeded = 0
    for _checkpoint in range(4):
        succeeded += sum(random_operations(kernel, rng, 40))
        assert_disk_is_fresh_render(kernel)
    assert succeeded >= 40, "the random operations barely changed anything; the check proves little"


def test_every_input_of_a_device_view_reaches_the_disk(vgpu: EmulatedKernel) -> None:
    """Steps that each change one thing a device's files show while its own fields stay put (its neighbours,
    the index it gets, the group it gets): a cache keyed on less than what the renderer reads fails here."""
    t4_type = f"{dev(T4)}/mdev_supported_types/nvidia-222/create"
    steps = [
        (dev(HDA, "remove"), "1"),  # the VGA function loses its consumer link
        ("sys/bus/pci/rescan", "1"),  # and gets it back
        (dev(H100, "driver_override"), "vfio-pci"),
        ("sys/bus/pci/drivers/nvidia/unbind", H100),
        ("sys/bus/pci/drivers_probe", H100),  # vfio0
        (dev(VGA, "driver_override"), "vfio-pci"),
        ("sys/bus/pci/drivers/nvidia/unbind", VGA),
        ("sys/bus/pci/drivers_probe", VGA),  # vfio1
        ("sys/bus/pci/drivers/vfio-pci/unbind", H100),
        ("sys/bus/pci/drivers/vfio-pci/unbind", VGA),
        ("sys/bus/pci/drivers_probe", VGA),  # the same devices, drivers and overrides: indexes swapped
        ("sys/bus/pci/drivers_probe", H100),
        (dev(NIC, "sriov_numvfs"), "2"),  # VFs in the lowest free IOMMU groups
        (dev(NIC, "sriov_numvfs"), "0"),
        (t4_type, "5a9b5b6e-2f9c-4a43-9d1d-0d8f1f2a3b4c"),  # an mdev takes one of those groups
        (dev(NIC, "sriov_numvfs"), "2"),  # the same VFs, in other groups
        (dev(L40S, "driver/unbind"), L40S),
        ("sys/bus/pci/drivers/pci-pf-stub/new_id", "10de 26b9"),
        (dev(L40S, "sriov_numvfs"), "2"),  # vendor-vGPU VFs
        (
            dev(L40S_VF0, "nvidia/current_vgpu_type"),
            "1151",
        ),  # VF1 now offers fewer types; nothing of its own changed
    ]
    for path, value in steps:
        vgpu.write(path, value)
        st = vgpu.snapshot()
        assert sysfs.render(st).nodes == full_render(st).nodes, f"after {path} <- {value}"
        assert_disk_is_fresh_render(vgpu)
    st = vgpu.snapshot()
    assert (st.devices[VGA].vfio_index, st.devices[H100].vfio_index) == (0, 1)
    assert (vgpu.root / dev("0000:05:00.5", "nvidia/creatable_vgpu_types")).read_text().count("\n") == 2


def test_hosts_with_other_topologies_share_no_stale_fragment(tmp_path: Path) -> None:
    """The memo is shared by every host of the process; the same addresses elsewhere in the topology, or with
    other neighbours, must not reuse each other's files (paths, bridge bus ranges, multifunction bits, links
    to consumers)."""
    first = build(tmp_path / "first", make_spec("datacenter"))
    spec = make_spec("datacenter")
    spec.devices = [
        replace(d, parent="0000:00:02.0")  # another bridge
        if d.address == H100
        else replace(d, consumers=())  # the audio function is only a sibling: multifunction alone
        if d.address == VGA
        else replace(d, consumers=(H100,))  # a consumer in another slot: the devlink alone
        if d.address == NIC
        else d
        for d in spec.devices
    ]
    second = build(tmp_path / "second", spec)
    override = (dev(H100, "driver_override"), "vfio-pci")
    steps = [override, (dev(HDA, "remove"), "1"), (dev(H100, "remove"), "1")]
    for k in (first, second):
        for path, value in steps:
            k.write(path, value)
            st = k.snapshot()
            assert sysfs.render(st).nodes == full_render(st).nodes, f"after {path} <- {value}"
            assert_disk_is_fresh_render(k)


def test_memoised_render_equals_a_full_render_at_every_step(kernel: EmulatedKernel) -> None:
    rng = random.Random(7)
    seen: set[str] = set()
    for _ in random_operations(kernel, rng, 60):
        st = kernel.snapshot()
        memoised, fresh = sysfs.render(st), full_render(st)
        assert memoised.nodes == fresh.nodes
        assert memoised.writable == fresh.writable
        seen.add(state_mod.dumps(st))
    assert len(seen) > 20


def test_diff_of_shared_fragments_equals_a_full_comparison(kernel: EmulatedKernel) -> None:
    rng = random.Random(11)
    old = sysfs.render(kernel.snapshot())
    compared = 0
    for _ in random_operations(kernel, rng, 80):
        new = sysfs.render(kernel.snapshot())
        gone, made = sysfs.changes(old, new)
        all_gone, all_made = sysfs.changes(sysfs.Tree(old.nodes), sysfs.Tree(new.nodes))  # no parts
        assert (sorted(gone), sorted(made)) == (sorted(all_gone), sorted(all_made))
        compared += bool(made or gone)
        old = new
    assert compared >= 10


def test_a_write_renders_only_the_device_it_changed(dc: EmulatedKernel) -> None:
    before = sysfs.render(dc.snapshot())
    dc.write(dev(H100, "driver_override"), "vfio-pci\n")
    after = sysfs.render(dc.snapshot())
    fresh = [f for f in after.parts if not any(f is g for g in before.parts)]
    assert len(fresh) == 3  # the device's own fragment, and the two small global ones rendered every time
    st = dc.snapshot()
    assert sysfs.changes(before, after) == (
        [],
        [f"{sysfs.device_path(st, st.devices[H100])}/driver_override"],
    )


def test_a_write_that_changes_nothing_saves_nothing(dc: EmulatedKernel) -> None:
    state_file = dc.root / ".gpumode-emulated/state.json"
    dc.write(dev(H100, "driver_override"), "vfio-pci\n")
    stat = state_file.stat()
    dc.write(dev(H100, "driver_override"), "vfio-pci\n")
    assert (state_file.stat().st_ino, state_file.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)


def test_another_process_changing_the_host_is_seen_despite_the_cache(dc: EmulatedKernel) -> None:
    override = dev(H100, "driver_override")
    dc.write(override, "vfio-pci\n")  # this process now caches the tree with the override set
    code = (
        "import sys; from gpumode.emulated.kernel import EmulatedKernel; "
        f"EmulatedKernel(sys.argv[1]).write('{override}', '\\n')"
    )
    subprocess.run([sys.executable, "-c", code, str(dc.root)], check=True)
    assert (dc.root / override).read_text() == "(null)\n"
    dc.write(override, "vfio-pci\n")  # diffed against a stale tree, this would change no file
    assert (dc.root / override).read_text() == "vfio-pci\n"
    assert_disk_is_fresh_render(dc)


def _die_in(monkeypatch: pytest.MonkeyPatch, name: str, after: int) -> None:
    """Kill the operation inside ``sysfs.<name>`` after ``after`` calls went through."""
    real = getattr(sysfs, name)
    calls = [0]

    def dying(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] > after:
            raise Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(sysfs, name, dying)


@pytest.mark.parametrize(("where", "after"), [("apply", 0), ("_write_file", 40)])
def test_a_process_killed_between_save_and_file_update_is_finished_by_the_next_operation(
    vgpu: EmulatedKernel, monkeypatch: pytest.MonkeyPatch, where: str, after: int
) -> None:
    with monkeypatch.context() as patch:
        _die_in(patch, where, after)
        with pytest.raises(Killed):
            vgpu.write(dev(NIC, "sriov_numvfs"), "4")  # VF dirs and links, new IOMMU groups, bound VFs
    kernel_mod._TREES.clear()  # the next operation runs in a new process
    assert vgpu.snapshot().devices[NIC].sriov_numvfs == 4  # saved before the files were touched
    assert (vgpu.root / ".gpumode-emulated" / state_mod.PREVIOUS_FILE).exists()
    vgpu.write(dev(T4, "driver_override"), "pci-stub\n")
    assert not (vgpu.root / ".gpumode-emulated" / state_mod.PREVIOUS_FILE).exists()
    assert_disk_is_fresh_render(vgpu)


def test_a_process_killed_before_saving_changes_nothing(
    vgpu: EmulatedKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = on_disk(vgpu.root)
    with monkeypatch.context() as patch:
        patch.setattr(state_mod, "store", lambda root, text: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            vgpu.write(dev(T4, "driver_override"), "vfio-pci\n")
    kernel_mod._TREES.clear()
    vgpu.close_all("nobody")  # any operation: finds the interrupted one and finishes it (a no-op here)
    assert vgpu.snapshot().devices[T4].driver_override is None
    assert on_disk(vgpu.root) == before
