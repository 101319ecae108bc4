"""A rollout preview's figures for a whole group, read in SQL on SQLite and PostgreSQL: they count only the
group's members, and the members the whitelist refuses are exactly those the planner refuses for it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine, insert, select
from sqlalchemy.orm import Session

from gpumode.cloud.embedded import EmbeddedPlatform
from gpumode.domain import HostSnapshot, Mode, SwitchRequest, VmPolicy
from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures import get_fixture
from gpumode.host.discover import discover
from gpumode.modes.policy import RequestError
from gpumode.server import db, sync, whitelist
from gpumode.server.models import HostGroup, Job, Node
from gpumode.server.schemas import Whitelist
from gpumode.server.switch.errors import NotFound
from gpumode.server.switch.planning import plan_for_node
from gpumode.server.web import group_figures

H100, T4 = "10de:2330", "10de:1eb8"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, HostSnapshot]:
    where = tmp_path_factory.mktemp("hosts")
    return {f: discover(create_host(get_fixture(f), where / f)) for f in ("hgx-h100", "t4-mdev")}


def _vm(name: str, running: bool) -> dict[str, object]:
    return {"name": name, "uuid": f"uuid-{name}", "running": running, "devices": []}


def _seed(engine: Engine, hosts: dict[str, HostSnapshot]) -> dict[str, int]:
    """Group ``g``: the H100 host (two VMs, one running) and the T4 host (a queued job, no VMs reported);
    group ``other``: a second T4 host with three running VMs and a job of its own, which no figure of ``g``
    may count."""
    db.upgrade(engine)
    now = datetime.now(UTC)
    h100, t4 = hosts["hgx-h100"], hosts["t4-mdev"]
    t4_other = HostSnapshot.from_dict({**t4.to_dict(), "hostname": "t4-other"})
    with Session(engine) as session, session.begin():
        groups = {name: HostGroup(name=name, created_at=now) for name in ("g", "other")}
        session.add_all(groups.values())
        platform = EmbeddedPlatform(session)
        for snapshot in (h100, t4, t4_other):
            sync.apply_snapshot(session, platform, snapshot, now=now)
        session.flush()
        nodes = {n.name: n for n in session.scalars(select(Node))}
        nodes[h100.hostname].group_id = groups["g"].id
        nodes[h100.hostname].vms = [_vm("a", True), _vm("b", False)]
        nodes[t4.hostname].group_id = groups["g"].id
        nodes["t4-other"].group_id = groups["other"].id
        nodes["t4-other"].vms = [_vm(f"o{i}", True) for i in range(3)]
        session.execute(
            insert(Job),
            [
                {"node_id": nodes[name].id, "node": name, "state": "queued", "host_state": "pending",
                 "request": {}, "plan": {}, "steps": [], "cancel_requested": False, "created_at": now,
                 "updated_at": now}
                for name in (t4.hostname, "t4-other")
            ],
        )  # fmt: skip
        return {"g": groups["g"].id, "other": groups["other"].id}


def test_group_figures_count_only_the_members(empty: Engine, hosts: dict[str, HostSnapshot]) -> None:
    ids = _seed(empty, hosts)
    h100, t4 = hosts["hgx-h100"], hosts["t4-mdev"]
    with Session(empty) as session:
        f = group_figures.figures(session, ids["g"], "g", Mode.PASSTHROUGH, Whitelist())
        assert group_figures.group_id(session, "g") == ids["g"]
        with pytest.raises(NotFound, match="no host group named 'nope'"):
            group_figures.group_id(session, "nope")
        pages = [[n.name for n in group_figures.member_page(session, ids["g"], p, 1)] for p in (1, 2, 3)]
    assert f.members == 2 and f.hosts_by_mode == {"accel": 1, "none": 1}
    assert f.gpus_by_mode == {"accel": len(h100.gpus), "none": len(t4.gpus)}
    assert (f.vms, f.vms_running, f.hosts_with_vms) == (2, 1, 1)
    assert f.busy == 1 and (f.refused, f.refused_named) == (0, [])
    assert pages == [[h100.hostname], [t4.hostname], []]  # by name, as a rollout starts them


@pytest.mark.parametrize(
    "rules",
    [
        Whitelist(models={T4: [Mode.ACCEL]}),  # the T4 host only
        Whitelist(models={H100: [Mode.ACCEL, Mode.VGPU], T4: [Mode.PASSTHROUGH]}),  # the H100 host only
        Whitelist(groups={"g": [Mode.ACCEL]}),  # every member
        Whitelist(platform=[Mode.ACCEL, Mode.VGPU]),  # every member
        Whitelist(groups={"other": [Mode.ACCEL]}, models={H100: [Mode.PASSTHROUGH]}),  # none
    ],
    ids=["model-t4", "model-h100", "group", "platform", "none"],
)
def test_whitelist_refusals_are_the_planners(
    empty: Engine, hosts: dict[str, HostSnapshot], rules: Whitelist
) -> None:
    ids = _seed(empty, hosts)
    request = SwitchRequest(mode=Mode.PASSTHROUGH, gpus=[], vm_policy=VmPolicy.ALL)
    with Session(empty) as session:
        whitelist.store(session, rules)  # the planner reads the rules from the database, as the service does
        f = group_figures.figures(session, ids["g"], "g", Mode.PASSTHROUGH, rules)
        planner: dict[str, str] = {}
        for node in group_figures.member_page(session, ids["g"], 1, 10):
            try:
                plan_for_node(session, node, request, whitelist.rules(session), EmbeddedPlatform(session))
            except RequestError as exc:
                if exc.code == "mode_not_allowed" and "disabled" in exc.message:
                    planner[node.name] = exc.message
    assert f.refused == len(f.refused_named) == len(planner)
    for name, why in f.refused_named:
        assert why in planner[name]  # the same level, worded as the planner words it
