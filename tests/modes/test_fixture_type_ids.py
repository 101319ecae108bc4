"""On every emulated fixture, a plan for each vGPU type a GPU offers writes NVIDIA's real id for it.

The ids come from ``tests/published_vgpu_types.py`` (written from NVIDIA's tables and a real host's list, not
from gpumode's catalog), so a catalog, fixture or planner that shifts an id fails here.
"""

from __future__ import annotations

import pytest

from gpumode.domain import Mode, SwitchRequest, VmPolicy
from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures import FIXTURES
from gpumode.host.discover import discover
from gpumode.host.root import Host
from gpumode.modes.catalog import load_catalog
from gpumode.modes.plan import plan_switch
from gpumode.modes.policy import load_whitelist, vgpu_offer
from host_templates import HostTemplates
from published_vgpu_types import PUBLISHED

CATALOG = load_catalog()
WHITELIST = load_whitelist()
# H100 SXM5 ids are not checked against a published table (no real host's list found): no board to compare
UNPUBLISHED = {(0x2330, 0x16C1)}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_offered_type_is_planned_with_nvidias_id(name: str, host_templates: HostTemplates) -> None:
    root = host_templates.template(name, lambda r: create_host(name, r))
    snap = discover(Host(root))
    checked = 0
    for gpu in snap.gpus:
        pf = snap.function(gpu.address)
        assert pf is not None
        board = (pf.device, pf.subsystem_device)
        offer = vgpu_offer(snap, gpu, CATALOG)
        if board in UNPUBLISHED or offer is None:
            continue
        published = PUBLISHED[board]
        # only this board's own types: an A2 (10de:25b6 like the A16) is never offered A16 types
        assert {t.name for t in offer.types} <= set(published), f"{name} {gpu.address}"
        for vtype in offer.types:
            request = SwitchRequest(Mode.VGPU, [gpu.address], vtype.name, 1, vm_policy=VmPolicy.ALL)
            plan = plan_switch(snap, [], request, catalog=CATALOG, whitelist=WHITELIST)
            creates = [s for s in plan.steps if s.action == "vgpu.create"]
            if not creates:  # the GPU already carries exactly this layout
                continue
            for step in creates:
                real = published[vtype.name]
                wrote = step.params["type_id"] if step.params["interface"] == "mdev" else step.params["type"]
                assert wrote in (real, f"nvidia-{real}"), f"{name} {gpu.address} {vtype.name}: {wrote}"
                assert step.params["name"] == vtype.name
            checked += 1
    if name == "hgx-h100":
        assert checked == 0  # H100 only: nothing published to compare with
    else:
        assert checked > 0
