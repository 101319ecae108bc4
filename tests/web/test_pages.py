"""The dashboard's pages over the real app: what they show, what each role may do, and that refusals
change nothing."""

from __future__ import annotations

import json
import re

from gpumode.server.web import queries
from gpumode.server.web.admin import whitelist_from_form

from .support import HGX, L40S, Dash

PLAN = {"mode": "vgpu", "vgpu_type": "NVIDIA H100XM-20C", "vgpu_count": "2", "vm_policy": "all"}


def _jobs(dash: Dash) -> list[dict[str, object]]:
    found: list[dict[str, object]] = dash.api("GET", "/jobs").json()  # type: ignore[attr-defined]
    return found


def test_fleet_shows_every_host_with_modes_totals_and_cards(dash: Dash) -> None:
    dash.sign_in(dash.admin)
    html = dash.client.get("/ui/").text
    for name in (HGX, L40S):
        assert f'href="/ui/nodes/{name}"' in html
    assert 'class="gpu-dot mode-bg-accel"' in html and 'class="gpu-dot mode-bg-vgpu"' in html
    assert re.search(r'<div class="num">2</div><div class="lbl">hosts</div>', html)
    only_vgpu = dash.client.get("/ui/", params={"mode": "vgpu"}).text
    assert L40S in only_vgpu and HGX not in only_vgpu


def test_fleet_pages_and_filters_in_sql(dash: Dash) -> None:
    with dash.client.app.state.gpumode.sessions() as session:  # type: ignore[attr-defined]
        first = queries.fleet_page(session, queries.FleetFilter(), {}, page_size=1)
        second = queries.fleet_page(session, queries.FleetFilter(page=2), {}, page_size=1)
        h100 = queries.fleet_page(session, queries.FleetFilter(model="10de:2330"), {})
    assert (first.matching, first.pages, [r.name for r in first.rows]) == (2, 2, [HGX])
    assert [r.name for r in second.rows] == [L40S]
    assert [r.name for r in h100.rows] == [HGX]
    cards = dash.api("GET", "/cards").json()  # type: ignore[attr-defined]
    assert first.gpus_total == len({(c["node"], c["gpu"]) for c in cards})  # GPUs that offer cards
    assert first.hosts_by_mode["accel"] == first.hosts_by_mode["vgpu"] == 1
    assert first.models == ["10de:2330", "10de:26b9"]


def test_host_page_shows_gpus_topology_cards_vms_and_driver(dash: Dash) -> None:
    dash.sign_in(dash.admin)
    html = dash.client.get(f"/ui/nodes/{HGX}").text
    detail = dash.api("GET", f"/nodes/{HGX}").json()  # type: ignore[attr-defined]
    for gpu in detail["gpus"]:
        assert gpu["address"] in html
    assert str(detail["gpus"][0]["iommu_group"]) in html
    assert html.count('class="card-status st-free"') == len(detail["cards"])
    assert 'id="switch"' in html
    assert dash.client.get("/ui/nodes/nope").status_code == 404


def test_viewer_sees_no_switch_button_and_gets_403_when_posting(dash: Dash) -> None:
    dash.sign_in(dash.token("viewer", "vic"))
    assert 'id="switch"' not in dash.client.get(f"/ui/nodes/{HGX}").text
    csrf = dash.csrf()
    for path in (f"/ui/nodes/{HGX}/switch/preview", f"/ui/nodes/{HGX}/switch"):
        r = dash.client.post(path, data={"csrf": csrf, **PLAN})
        assert r.status_code == 403 and "operator role" in r.text
    assert _jobs(dash) == []
    audit = dash.api("GET", "/audit", params={"actor": "vic"}).json()  # type: ignore[attr-defined]
    assert [a["status_code"] for a in audit] == [403, 403]


def test_posts_without_the_csrf_token_are_refused(dash: Dash) -> None:
    dash.sign_in(dash.token("operator", "olga"))
    r = dash.client.post(f"/ui/nodes/{HGX}/switch", data=PLAN)
    assert r.status_code == 403 and "CSRF" in r.text
    r = dash.client.post(f"/ui/nodes/{HGX}/switch", data={**PLAN, "csrf": "forged"})
    assert r.status_code == 403
    assert _jobs(dash) == []


def test_preview_shows_the_plan_then_confirm_makes_that_job(dash: Dash) -> None:
    dash.sign_in(dash.token("operator", "olga"))
    csrf = dash.csrf()
    preview = dash.client.post(f"/ui/nodes/{HGX}/switch/preview", data={"csrf": csrf, **PLAN})
    assert preview.status_code == 200
    dry = dash.api("POST", f"/nodes/{HGX}/switch", params={"dry_run": "true"},
                   json={**PLAN, "vgpu_count": 2}).json()  # type: ignore[attr-defined]  # fmt: skip
    for step in dry["plan"]["steps"]:
        assert step["action"] in preview.text
    assert _jobs(dash) == []  # a preview stores nothing
    r = dash.client.post(f"/ui/nodes/{HGX}/switch", data={"csrf": csrf, **PLAN}, follow_redirects=False)
    assert r.status_code == 303
    job = _jobs(dash)[0]
    assert r.headers["location"] == f"/ui/jobs/{job['id']}"
    assert job["state"] == "queued" and job["created_by"] == "olga"
    assert [s["id"] for s in job["plan"]["steps"]] == [s["id"] for s in dry["plan"]["steps"]]  # type: ignore[index]
    page = dash.client.get(r.headers["location"]).text
    assert 'id="cancel"' in page and "job.js" in page
    again = dash.client.post(f"/ui/nodes/{HGX}/switch", data={"csrf": csrf, **PLAN})
    assert again.status_code == 409 and f"/ui/jobs/{job['id']}" in again.text


def test_a_refused_request_shows_the_policy_error_and_stores_nothing(dash: Dash) -> None:
    dash.sign_in(dash.token("operator", "olga"))
    r = dash.client.post(
        f"/ui/nodes/{HGX}/switch/preview", data={"csrf": dash.csrf(), "mode": "vgpu", "vgpu_type": "no-such"}
    )
    assert r.status_code == 422 and "vgpu type not offered" in r.text
    r = dash.client.post(f"/ui/nodes/{HGX}/switch", data={"csrf": dash.csrf(), "mode": "warp"})
    assert r.status_code == 422 and "mode" in r.text
    assert _jobs(dash) == []


def test_modes_outside_the_whitelist_are_disabled_with_the_reason(dash: Dash) -> None:
    r = dash.api("PUT", "/modes", json={"platform": ["accel", "vgpu"], "groups": {}, "models": {}})
    assert r.status_code == 200  # type: ignore[attr-defined]
    dash.sign_in(dash.admin)
    html = dash.client.get(f"/ui/nodes/{HGX}/switch").text
    radio = re.search(r'<input type="radio" name="mode" value="passthrough"[^>]*>', html)
    assert radio is not None and "disabled" in radio.group(0)
    assert "disabled platform-wide" in html


def test_cancel_ends_a_queued_job_and_the_stream_says_so(dash: Dash) -> None:
    dash.sign_in(dash.admin)
    csrf = dash.csrf()
    dash.client.post(f"/ui/nodes/{HGX}/switch", data={"csrf": csrf, **PLAN})
    job_id = _jobs(dash)[0]["id"]
    r = dash.client.post(f"/ui/jobs/{job_id}/cancel", data={"csrf": csrf}, follow_redirects=False)
    assert r.status_code == 303
    assert _jobs(dash)[0]["state"] == "cancelled"
    with dash.client.stream("GET", f"/ui/jobs/{job_id}/stream") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        body = "".join(stream.iter_text())
    first = json.loads(body.split("data: ", 1)[1].split("\n", 1)[0])
    assert first["job"]["state"] == "cancelled" and first["job"]["active"] is False
    assert {c["kind"] for c in first["cards"]} == {"accel"}
    assert "event: end" in body
    assert dash.client.post(f"/ui/jobs/{job_id}/cancel", data={"csrf": csrf}).status_code == 409


def test_whitelist_form_is_for_admins_and_profiles_for_operators(dash: Dash) -> None:
    dash.sign_in(dash.token("operator", "olga"))
    csrf = dash.csrf()
    r = dash.client.post("/ui/whitelist/modes", data={"csrf": csrf, "platform": ["accel"]})
    assert r.status_code == 403
    r = dash.client.post(
        "/ui/whitelist/profiles",
        data={"csrf": csrf, "name": "h100-20c", "vgpu_type": "NVIDIA H100XM-20C", "count_per_gpu": "2",
              "action": "save"},
        follow_redirects=False,
    )  # fmt: skip
    assert r.status_code == 303
    assert [p["name"] for p in dash.api("GET", "/profiles").json()] == ["h100-20c"]  # type: ignore[attr-defined]
    bad = {"csrf": csrf, "name": "bad name", "product_id": "2330"}
    r = dash.client.post("/ui/whitelist/aliases", data=bad)
    assert r.status_code == 422 and "alias" in r.text
    dash.sign_in(dash.admin)
    r = dash.client.post(
        "/ui/whitelist/modes",
        data={"csrf": dash.csrf(), "platform": ["accel", "passthrough"], "model_key": ["10de:2330"],
              "model:0": ["accel"]},
        follow_redirects=False,
    )  # fmt: skip
    assert r.status_code == 303
    wl = dash.api("GET", "/modes").json()  # type: ignore[attr-defined]
    assert wl["platform"] == ["accel", "passthrough"] and wl["models"] == {"10de:2330": ["accel"]}
    r = dash.client.post("/ui/whitelist/modes", data={"csrf": dash.csrf(), "narrow:ghost": "1"})
    assert r.status_code == 422 and "ghost" in r.text


def test_whitelist_form_reading() -> None:
    doc = whitelist_from_form(
        {
            "platform": ["accel"],
            "narrow:inference": ["1"],
            "group:inference": ["accel"],
            "group:batch": ["vgpu"],
            "model_key": ["10DE:1EB8", ""],
            "model:0": ["passthrough"],
            "model:1": ["vgpu"],
        }
    )
    assert doc == {
        "platform": ["accel"],
        "groups": {"inference": ["accel"]},
        "models": {"10de:1eb8": ["passthrough"]},
    }


def test_events_are_searchable_and_the_audit_log_is_for_admins(dash: Dash) -> None:
    dash.sign_in(dash.token("viewer", "vic"))
    html = dash.client.get("/ui/events", params={"q": HGX}).text
    assert HGX in html and L40S not in html.split('id="events"')[1]
    assert dash.client.get("/ui/audit").status_code == 403
    dash.sign_in(dash.admin)
    audit = dash.client.get("/ui/audit", params={"q": "tokens"}).text
    assert "POST /api/v1/tokens" in audit and "agents/join" not in audit
