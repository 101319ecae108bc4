"""One switch request contract: the same malformed request gets the same error code from the local CLI, the
REST API and the dashboard (the table in ``gpumode.errors.CODES``, docs/api.md); and every way into a switch
writes exactly one audit row and wakes the agent, through the one switch service."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpumode.cli.main import app as cli
from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures import get_fixture
from gpumode.host.root import Host

from .support import HGX, L40S, Dash

FIXTURE = {L40S: "l40s-sriov", HGX: "hgx-h100"}
NO_VGPU = "version: v1\nplatform:\n  modes: [accel, passthrough]\n"

# (case, host, request as the API's body, expected code); the CLI gets the same fields as options
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("unknown mode", L40S, {"mode": "turbo"}, "unknown_mode"),
    ("bad GPU address", L40S, {"mode": "accel", "gpus": ["not-an-address"]}, "bad_address"),
    ("unknown GPU", L40S, {"mode": "accel", "gpus": ["0000:ff:00.0"]}, "unknown_gpu"),
    ("vGPU type not offered", L40S, {"mode": "vgpu", "vgpu_type": "NOPE-9Q"}, "vgpu_type_not_offered"),
    (
        "too many vGPUs",
        L40S,
        {"mode": "vgpu", "vgpu_type": "L40S-48Q", "vgpu_count": 9},
        "vgpu_count_exceeds",
    ),
    ("mode not on the whitelist", L40S, {"mode": "vgpu", "vgpu_type": "L40S-4Q"}, "mode_not_allowed"),
    ("accel and vgpu on one host", HGX, {"mode": "vgpu", "gpus": ["first"]}, "incompatible_modes"),
]


@pytest.fixture(scope="module")
def local_hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Host]:
    """The same two hosts the dashboard's seed joined, for the local CLI."""
    where = tmp_path_factory.mktemp("contract")
    return {name: create_host(get_fixture(fixture), where / fixture) for name, fixture in FIXTURE.items()}


def _body(case: str, host: str, body: dict[str, Any], dash: Dash) -> dict[str, Any]:
    if body.get("gpus") == ["first"]:
        gpus = dash.api("GET", f"/nodes/{host}").json()["gpus"]  # type: ignore[attr-defined]
        body = {**body, "gpus": [gpus[0]["address"]]}
    return body


def _local_code(root: Path, body: dict[str, Any]) -> str:
    args = ["plan", "--root", str(root), "--mode", body["mode"]]
    for gpu in body.get("gpus", []):
        args += ["--gpu", gpu]
    if "vgpu_type" in body:
        args += ["--vgpu-type", body["vgpu_type"]]
    if "vgpu_count" in body:
        args += ["--count", str(body["vgpu_count"])]
    result = CliRunner().invoke(cli, args, env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    found = re.search(r"error \[([a-z_]+)\]", result.output)
    assert found is not None, result.output
    return found.group(1)


def _rest_code(dash: Dash, host: str, body: dict[str, Any]) -> str:
    r = dash.api("POST", f"/nodes/{host}/switch", params={"dry_run": "true"}, json=body)
    assert r.status_code == 422, r.text  # type: ignore[attr-defined]
    code: str = r.json()["detail"]["code"]  # type: ignore[attr-defined]
    return code


def _dashboard_code(dash: Dash, host: str, body: dict[str, Any]) -> str:
    form: dict[str, Any] = {k: str(v) for k, v in body.items() if k != "gpus"}
    form["gpus"] = body.get("gpus", [])
    r = dash.client.post(f"/ui/nodes/{host}/switch/preview", data={"csrf": dash.csrf(), **form})
    assert r.status_code == 422, r.text
    found = re.search(r'id="error" data-code="([a-z_]+)"', r.text)
    assert found is not None, r.text
    return found.group(1)


@pytest.mark.parametrize(("case", "host", "body", "code"), CASES, ids=[c[0] for c in CASES])
def test_the_same_bad_request_gets_the_same_code_everywhere(
    dash: Dash, local_hosts: dict[str, Host], case: str, host: str, body: dict[str, Any], code: str
) -> None:
    root = local_hosts[host].root
    whitelist = root / "etc/gpumode/whitelist.yaml"
    if case == "mode not on the whitelist":
        whitelist.parent.mkdir(parents=True, exist_ok=True)
        whitelist.write_text(NO_VGPU)
        r = dash.api("PUT", "/modes", json={"platform": ["accel", "passthrough"]})
        assert r.status_code == 200, r.text  # type: ignore[attr-defined]
    try:
        body = _body(case, host, body, dash)
        local = _local_code(root, body)
        rest = _rest_code(dash, host, body)
        dash.sign_in(dash.token("operator", "olga"))
        shown = _dashboard_code(dash, host, body)
    finally:
        whitelist.unlink(missing_ok=True)
    assert (local, rest, shown) == (code, code, code)


# --- every way in: one audit row, one wake-up -----------------------------------------------------------


@pytest.fixture
def woken(dash: Dash, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The nodes whose agents the server woke, in order."""
    wakeups = dash.client.app.state.gpumode.wakeups  # type: ignore[attr-defined]
    seen: list[str] = []
    monkeypatch.setattr(wakeups, "notify", seen.append)
    yield seen


def _audit(dash: Dash) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = dash.api("GET", "/audit", params={"limit": 1000}).json()  # type: ignore[attr-defined]
    return found


PASSTHROUGH = {"mode": "passthrough", "vm_policy": "all"}


def _group(dash: Dash) -> None:
    r = dash.api("PUT", "/groups/gpu-a", json={"nodes": [HGX, L40S]})
    assert r.status_code == 200, r.text  # type: ignore[attr-defined]


def _api_switch(dash: Dash) -> tuple[str, list[str]]:
    r = dash.api("POST", f"/nodes/{L40S}/switch", json=PASSTHROUGH)
    assert r.status_code == 201, r.text  # type: ignore[attr-defined]
    return f"node:{L40S}", [L40S]


def _api_group(dash: Dash) -> tuple[str, list[str]]:
    body = {**PASSTHROUGH, "concurrency": 2}
    r = dash.api("POST", "/groups/gpu-a/switch", json=body)
    assert r.status_code == 201, r.text  # type: ignore[attr-defined]
    return "group:gpu-a", [HGX, L40S]


def _dashboard_switch(dash: Dash) -> tuple[str, list[str]]:
    data = {"csrf": dash.csrf(), **PASSTHROUGH}
    r = dash.client.post(f"/ui/nodes/{L40S}/switch", data=data, follow_redirects=False)
    assert r.status_code == 303, r.text
    return f"node:{L40S}", [L40S]


def _dashboard_rollout(dash: Dash) -> tuple[str, list[str]]:
    data = {"csrf": dash.csrf("/ui/rollouts"), "group": "gpu-a", **PASSTHROUGH, "concurrency": "2"}
    r = dash.client.post("/ui/rollouts", data=data, follow_redirects=False)
    assert r.status_code == 303, r.text
    return "group:gpu-a", [HGX, L40S]


CALLERS = {
    "api switch": _api_switch,
    "api group": _api_group,
    "dashboard switch": _dashboard_switch,
    "dashboard rollout": _dashboard_rollout,
}


@pytest.mark.parametrize("caller", list(CALLERS))
def test_every_way_in_writes_one_audit_row_and_wakes_the_agents(
    dash: Dash, woken: list[str], caller: str
) -> None:
    _group(dash)
    dash.sign_in(dash.token("operator", "olga"))
    before = {e["id"] for e in _audit(dash)}
    target, nodes = CALLERS[caller](dash)
    new = [e for e in _audit(dash) if e["id"] not in before]
    assert len(new) == 1, new
    assert new[0]["target"] == target and new[0]["status_code"] == 201, new
    assert new[0]["actor"] == ("olga" if caller.startswith("dashboard") else "admin")
    assert sorted(woken) == sorted(nodes)  # each agent once, after the commit


def test_a_refused_switch_wakes_nobody(dash: Dash, woken: list[str]) -> None:
    r = dash.api("POST", f"/nodes/{L40S}/switch", json={"mode": "turbo"})
    assert r.status_code == 422, r.text  # type: ignore[attr-defined]
    assert woken == []


def test_a_rollout_refusal_names_the_choices_not_the_members(dash: Dash) -> None:
    """The vGPU types every refused member offers, never the names of the members that could switch."""
    r = dash.api("PUT", "/groups/gpu-b", json={"nodes": [L40S]})
    assert r.status_code == 200, r.text  # type: ignore[attr-defined]
    r = dash.api("POST", "/groups/gpu-b/switch", json={"mode": "vgpu", "vgpu_type": "NOPE-9Q"})
    assert r.status_code == 422, r.text  # type: ignore[attr-defined]
    detail = r.json()["detail"]  # type: ignore[attr-defined]
    assert detail["code"] == "not_plannable" and L40S in detail["message"]
    assert detail["choices"] and all("L40S" in c for c in detail["choices"]), detail
    _group(dash)  # one H100 and one L40S host: no vGPU type both offer
    r = dash.api("POST", "/groups/gpu-a/switch", json={"mode": "vgpu", "vgpu_type": "NOPE-9Q"})
    detail = r.json()["detail"]  # type: ignore[attr-defined]
    assert detail["code"] == "not_plannable" and detail["choices"] == [], detail
