"""The dashboard in real headless Chromium against a demo stack: a server and one ``gpumode agent`` per
emulated host. Signs in, opens the fleet and a host, previews and confirms a switch, watches the job page
reach ``succeeded`` without a reload (server-sent events), sees the cards change; a viewer sees no switch
button and is refused when it posts anyway. Saves a screenshot of each page to ``artifacts/screenshots/``
(ignored by git); with ``GPUMODE_UPDATE_SCREENSHOTS=1`` to ``docs/screenshots/``, which the README shows.

Skips, saying why, when Playwright or Chromium (``/usr/bin/chromium``, Debian's ``chromium`` package,
installed by ``scripts/install-system-deps.sh``) is missing or cannot start. Marked ``slow`` (~25 s: real
agents run a real switch); CI still runs it.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpumode.cli.demo_stack import DemoStack

pytest.importorskip("playwright", reason="the playwright package is not installed (pip install playwright)")
from playwright.sync_api import Browser, Error, Page, expect, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
UPDATE_DOCS = os.environ.get("GPUMODE_UPDATE_SCREENSHOTS") == "1"
SHOTS = Path(__file__).resolve().parents[2] / ("docs" if UPDATE_DOCS else "artifacts") / "screenshots"
HGX, L40S = "hgx-h100-01", "l40s-node-03"
VGPU_TYPE = "NVIDIA H100XM-20C"
JOB_TIMEOUT_MS = 90_000  # the whole switch on two busy cores takes ~10-20 s
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium (scripts/install-system-deps.sh)")
    with sync_playwright() as p:
        try:
            found = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        except Error as exc:
            pytest.skip(f"chromium cannot start here: {str(exc).splitlines()[0]}")
        yield found
        found.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoStack]:
    demo = DemoStack(tmp_path_factory.mktemp("dash") / "demo")
    try:
        demo.start_server()
        for fixture in ("hgx-h100", "l40s-sriov"):
            demo.start_agent(demo.create_host(fixture).hostname)
        _wait_for_nodes(demo, {HGX, L40S})
        yield demo
    finally:
        demo.stop()


def _api(stack: DemoStack, method: str, path: str, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {stack.admin_token}"}
    return httpx.request(method, f"{stack.url}/api/v1{path}", headers=headers, timeout=10, **kw)


def _wait_for_nodes(stack: DemoStack, names: set[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stack.check_agents()
        if names <= {n["name"] for n in _api(stack, "GET", "/nodes").json()}:
            return
        time.sleep(0.3)
    raise AssertionError(f"the agents of {sorted(names)} did not join within 60 s")


def _sign_in(page: Page, stack: DemoStack, token: str) -> None:
    page.goto(f"{stack.url}/ui/login")
    page.fill("#token", token)
    page.click("button[type=submit]")
    expect(page.locator("#fleet")).to_be_visible()


def _shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_operator_switches_a_host_and_watches_the_job_live(browser: Browser, stack: DemoStack) -> None:
    _api(stack, "PUT", "/profiles/h100-20c", json={"vgpu_type": VGPU_TYPE, "count_per_gpu": 2,
                                                    "description": "two 40 GB slices per H100"})  # fmt: skip
    _api(stack, "PUT", "/aliases/h100-pt", json={"vendor_id": "10de", "product_id": "2330"})
    # H100s may not be passed through: the form shows that mode disabled, with the reason.
    wl = {
        "platform": ["accel", "vgpu", "passthrough"],
        "groups": {},
        "models": {"10de:2330": ["accel", "vgpu"]},
    }
    assert _api(stack, "PUT", "/modes", json=wl).status_code == 200
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    _sign_in(page, stack, stack.admin_token)
    expect(page.locator(f'tr[data-host="{HGX}"]')).to_contain_text("accel")
    expect(page.locator(f'tr[data-host="{L40S}"]')).to_contain_text("vgpu")
    _shot(page, "fleet")

    page.click(f'a.host:text("{HGX}")')
    expect(page.locator("#gpus")).to_contain_text("0000:")
    _shot(page, "host")

    page.click("#switch")
    expect(page.locator("input[name=mode][value=passthrough]")).to_be_disabled()
    page.check("input[name=mode][value=vgpu]")
    page.select_option("select[name=vgpu_type]", VGPU_TYPE)
    page.fill("input[name=vgpu_count]", "2")
    page.select_option("select[name=vm_policy]", "all")
    _shot(page, "switch")
    page.click("#preview")
    expect(page.locator("#plan-steps")).to_contain_text("cloud.register_cards")
    _shot(page, "preview")

    page.click("#confirm")
    expect(page.locator("#steps")).to_be_visible()
    page.evaluate("window.__sameDocument = true")  # gone if the page were reloaded
    expect(page.locator("#job-state")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
    assert page.evaluate("window.__sameDocument === true"), "the job page reloaded instead of updating live"
    expect(page.locator("#job-progress .progress-text")).to_contain_text("· 100%")  # painted live
    expect(page.locator("#cards tbody")).to_contain_text("vgpu")
    expect(page.locator("#cards tbody")).not_to_contain_text("accel")
    assert page.locator("#cancel").count() == 0
    _shot(page, "job")

    page.goto(f"{stack.url}/ui/nodes/{HGX}")
    expect(page.locator("#gpus")).to_contain_text("vgpu")
    page.goto(f"{stack.url}/ui/whitelist")
    _shot(page, "whitelist")
    page.goto(f"{stack.url}/ui/events")
    expect(page.locator("#events")).to_contain_text("job.succeeded")
    _shot(page, "events")
    page.goto(f"{stack.url}/ui/audit?actor=admin")
    expect(page.locator("#audit")).to_contain_text("/ui/nodes/{name}/switch")
    _shot(page, "audit")
    context.close()


def test_viewer_has_no_switch_button_and_is_refused(browser: Browser, stack: DemoStack) -> None:
    r = _api(stack, "POST", "/tokens", json={"name": "vera", "role": "viewer"})
    viewer = r.json()["token"]
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    _sign_in(page, stack, viewer)
    page.goto(f"{stack.url}/ui/nodes/{L40S}")
    expect(page.locator("#gpus")).to_be_visible()
    assert page.locator("#switch").count() == 0
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    before = len(_api(stack, "GET", "/jobs").json())
    answer = page.request.post(
        f"{stack.url}/ui/nodes/{L40S}/switch", form={"csrf": csrf or "", "mode": "accel", "vm_policy": "all"}
    )
    assert answer.status == 403
    assert len(_api(stack, "GET", "/jobs").json()) == before
    context.close()


def test_operator_rolls_a_group_out_and_watches_it_live(browser: Browser, stack: DemoStack) -> None:
    """Preview then confirm a rollout over a one-host group, and watch its page follow the job to the end."""
    assert _api(stack, "PUT", "/groups/vdi", json={"nodes": [L40S]}).status_code == 200
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    _sign_in(page, stack, stack.admin_token)
    page.goto(f"{stack.url}/ui/?group=vdi")
    page.click("#rollout-group")
    page.check("input[name=mode][value=accel]")
    page.select_option("select[name=vm_policy]", "all")
    page.click("#preview")
    expect(page.locator(f'#member-plans tr[data-node="{L40S}"]')).to_be_visible()
    _shot(page, "rollout-preview")

    page.click("#confirm")
    expect(page.locator("#members")).to_contain_text(L40S)
    page.evaluate("window.__sameDocument = true")
    expect(page.locator("#rollout-state")).to_have_text("succeeded", timeout=JOB_TIMEOUT_MS)
    assert page.evaluate("window.__sameDocument === true"), "the rollout page reloaded instead of updating"
    member = page.locator(f'tr[data-node="{L40S}"]')
    expect(member.locator(".member-state")).to_have_text("succeeded")
    expect(member.locator(".member-job a")).to_have_attribute("href", re.compile(r"^/ui/jobs/\d+$"))
    _shot(page, "rollout")
    page.goto(f"{stack.url}/ui/rollouts")
    expect(page.locator("#rollouts tbody tr")).to_have_count(1)
    _shot(page, "rollouts")
    context.close()
