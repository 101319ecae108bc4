"""The host side of delivering nova-compute's configuration: the ``file.write`` step (check, apply, undo
through the journaled runner) and the planned drop-in, predicted from the plan before the host is switched."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from gpumode.cloud.openstack.delivery import delivery_steps, predict
from gpumode.cloud.openstack.http import OpenStackError
from gpumode.cloud.openstack.novaconf import render_dropin
from gpumode.domain import Impact, Mode, Plan, Step, SwitchRequest
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.modes import engine
from gpumode.modes.journal import Journal, JournalStore, RunState
from gpumode.modes.run import Runner
from gpumode.modes.steps import StepContext, StepError, default_registry

from .conftest import Stack

WRITE = default_registry().get("file.write")


def ctx(host: Host, **params: Any) -> StepContext:
    step = Step(id="01-file.write-x", action="file.write", target="x", params=params)
    plan = Plan("h", SwitchRequest(mode=Mode.ACCEL), [step], Impact())
    record: dict[str, Any] = {}
    return StepContext(host, step, record, plan, save=lambda: None, hypervisor_factory=lambda: None)  # type: ignore[arg-type,return-value]


def test_file_write_apply_check_undo(tmp_path: Path) -> None:
    host = Host(tmp_path)
    c = ctx(host, path="/etc/nova/nova.conf.d/gpumode.conf", content="new\n", mode="0640")
    assert not WRITE.check(host, c)
    WRITE.apply(host, c)
    target = tmp_path / "etc/nova/nova.conf.d/gpumode.conf"
    assert target.read_text() == "new\n" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert WRITE.check(host, c) and c.record == {"previous": None, "previous_mode": None}
    WRITE.undo(host, c, c.record)
    assert not target.exists()  # there was no file before: undo removes it

    target.write_text("old\n")
    target.chmod(0o600)
    c = ctx(host, path="etc/nova/nova.conf.d/gpumode.conf", content="new\n")
    WRITE.apply(host, c)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    WRITE.undo(host, c, c.record)
    assert target.read_text() == "old\n" and stat.S_IMODE(target.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"path": "../outside", "content": "x"}, "outside the host root"),
        ({"path": "", "content": "x"}, "is not a path"),
        ({"path": "a", "content": "x", "mode": "rw"}, "is not octal"),
        ({"path": "a", "content": 3}, "is not text"),
    ],
)
def test_file_write_refuses_bad_params_and_changes_nothing(
    tmp_path: Path, params: dict[str, Any], message: str
) -> None:
    host = Host(tmp_path / "root")
    (tmp_path / "root").mkdir()
    with pytest.raises(StepError, match=message):
        WRITE.apply(host, ctx(host, **params))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]
    assert list((tmp_path / "root").iterdir()) == []


def test_a_rolled_back_delivery_restores_the_file_and_restarts_last(stack: Stack) -> None:
    """Through the journaled runner: the guard step's undo (the restart) runs after the file is back."""
    host = stack.host
    host.path("etc/nova/nova.conf.d").mkdir(parents=True)
    host.path(stack.config.nova_dropin).write_text("old\n")
    extra = delivery_steps(dropin_path=stack.config.nova_dropin, dropin="new\n", restart=["uname", "-n"])
    steps = [
        Step(id=f"{i:02d}-{s.action}-{s.target}", action=s.action, target=s.target, params=s.params)
        for i, s in enumerate([*extra.first, *extra.last], start=1)
    ]
    plan = Plan(stack.name, SwitchRequest(mode=Mode.ACCEL), steps, Impact())
    journal: Journal = JournalStore(host).create(plan, engine.new_plan_id(plan))
    assert Runner(host).run(journal).ok
    assert host.path(stack.config.nova_dropin).read_text() == "new\n"
    order: list[str] = []
    runner = Runner(host, progress=lambda e: order.append(f"{e.phase}:{e.step.id}:{e.state.value}"))
    result = runner.rollback(journal)
    assert result.state is RunState.ROLLED_BACK
    assert host.path(stack.config.nova_dropin).read_text() == "old\n"
    undone = [o.split(":")[1] for o in order if o.endswith(":undone")]
    assert undone[-1] == steps[0].id  # the restart of the restored configuration comes last


def test_predicted_dropin_matches_the_one_rendered_after_the_switch(stack: Stack) -> None:
    snapshot = discover(stack.host)
    plan = engine.plan(stack.host, SwitchRequest(mode=Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2))
    predicted = render_dropin(predict(plan, snapshot))
    stack.switch(Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2)
    assert predicted == render_dropin(discover(stack.host))
    assert "enabled_mdev_types = nvidia-" in predicted


def test_platform_host_steps_refuse_what_nova_cannot_be_configured_for(stack: Stack) -> None:
    snapshot = discover(stack.host)
    plan = engine.plan(stack.host, SwitchRequest(mode=Mode.VGPU, vgpu_type="GRID T4-2Q", vgpu_count=2))
    step = next(s for s in plan.steps if s.action == "vgpu.create")
    step.params = {**step.params, "vf_index": 3}  # as if the GPU's vGPUs lived on VFs not enabled yet
    with pytest.raises(OpenStackError, match=r"SR-IOV VFs that do not exist yet"):
        stack.platform.host_steps(plan, snapshot)
