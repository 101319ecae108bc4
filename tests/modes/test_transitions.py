"""Every transition between none, accel, vgpu and passthrough on every fixture, through the engine.

One emulated host per fixture walks a circuit that takes each ordered pair of requestable modes once
(accel→vgpu→passthrough→accel→passthrough→vgpu→accel), and "none" (a reboot: no module, no binding) to each
mode. After every switch ``assert`` must pass and lspci, reading the same sysfs, must show the mode's driver
on every GPU and companion. Modes a fixture cannot do (whitelist/compatibility) are skipped from its circuit —
the planner's refusal is tested with the planner.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support import (
    FIXTURES,
    check_drivers_with_lspci,
    make_host,
    orphan_mdevs,
    reboot,
    request_for,
    view,
)

from gpumode.domain import Mode, SwitchRequest
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.modes import engine
from gpumode.modes.desired import load_desired
from gpumode.modes.journal import JournalStore

CIRCUIT = (Mode.ACCEL, Mode.VGPU, Mode.PASSTHROUGH, Mode.ACCEL, Mode.PASSTHROUGH, Mode.VGPU, Mode.ACCEL)


def possible_modes(host: Host) -> dict[Mode, SwitchRequest]:
    requests = {mode: request_for(host, mode) for mode in (Mode.ACCEL, Mode.VGPU, Mode.PASSTHROUGH)}
    return {mode: r for mode, r in requests.items() if r is not None}


def switch(host: Host, request: SwitchRequest, came_from: str) -> None:
    mode = request.mode
    result = engine.apply(host, request)
    assert result.ok, f"{came_from} → {mode.value}: {result.run.error if result.run else result}"
    differences = engine.assert_mode(host, mode)
    assert not differences, f"{came_from} → {mode.value}: {differences}"
    assert not check_drivers_with_lspci(host, mode), f"{came_from} → {mode.value}"
    assert not orphan_mdevs(host)
    assert JournalStore(host).unfinished() is None


@pytest.mark.slow  # the emulated hosts take seconds per switch: ~11 switches per fixture
@pytest.mark.parametrize("fixture", FIXTURES)
def test_every_transition_ends_in_the_requested_mode(tmp_path: Path, fixture: str) -> None:
    host = make_host(tmp_path / fixture, fixture)
    modes = possible_modes(host)
    assert modes, f"{fixture} allows no mode at all"
    circuit = [m for m in CIRCUIT if m in modes]
    previous = "start"
    for mode in circuit:
        switch(host, modes[mode], previous)
        previous = mode.value
    for request in modes.values():  # none → each mode
        reboot(host)
        assert all(g.mode is Mode.NONE for g in engine.status(host).gpus)
        switch(host, request, "none")


@pytest.mark.parametrize(
    "fixture", ["t4-mdev", pytest.param("l40s-sriov", marks=pytest.mark.slow), "rtx-workstation"]
)
def test_desired_state_comes_back_after_a_reboot(tmp_path: Path, fixture: str) -> None:
    host = make_host(tmp_path / fixture, fixture)
    modes = possible_modes(host)
    mode = Mode.VGPU if Mode.VGPU in modes else Mode.PASSTHROUGH
    switch(host, modes[mode], "start")
    before = view(host)
    desired = load_desired(host)
    assert {d.mode for d in desired.gpus.values()} == {mode}
    assert set(desired.gpus) == {g.address for g in engine.status(host).gpus}
    reboot(host)
    assert engine.assert_mode(host, mode)  # the reboot lost it
    results = engine.apply_desired(host)
    assert results and all(r.ok for r in results)
    assert not engine.assert_mode(host, mode)
    after = view(host)
    assert after["gpus"] == before["gpus"]  # same vGPUs (deterministic UUIDs), same VF counts
    # the GPUs and VFs are bound as before, and in passthrough the companions too. The emulated reboot loads
    # no module at boot (udev's coldplug is userspace's business), so a companion's own host driver (xhci_hcd,
    # snd_hda_intel) may be missing after it: that is not gpumode's to load.
    ours = {
        a
        for g in discover(host).gpus
        for a in (g.address, *g.vfs, *(g.companions if mode is Mode.PASSTHROUGH else ()))
    }
    assert {a: after["functions"][a] for a in ours} == {a: before["functions"].get(a) for a in ours}


@pytest.mark.parametrize(
    ("fixture", "mode"), [("t4-mdev", Mode.PASSTHROUGH), ("rtx-workstation", Mode.ACCEL)]
)
def test_one_switch_per_small_fixture(tmp_path: Path, fixture: str, mode: Mode) -> None:
    """The quick subset of the (slow) circuit above: none → passthrough, passthrough → accel."""
    host = make_host(tmp_path / "h", fixture)
    switch(host, possible_modes(host)[mode], "start")


def test_apply_twice_is_a_no_op_the_second_time(tmp_path: Path) -> None:
    host = make_host(tmp_path / "h", "t4-mdev")
    request = possible_modes(host)[Mode.PASSTHROUGH]
    switch(host, request, "start")
    again = engine.apply(host, request)
    assert again.ok and again.run is not None
    assert all(s.state.value == "skipped" for s in again.run.steps), [
        (s.id, s.state.value) for s in again.run.steps
    ]
