"""The dashboard's pages over the real app: what they show, what each role may do, and that refusals
change nothing."""

from __future__ import annotations

import json
import re

import pytest

from gpumode.server.web import queries
from gpumode.server.web import rollouts as web_rollouts
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
    state = dash.client.app.state.gpumode  # type: ignore[attr-defined]
    with state.sessions() as session:
        platform = state.platform_factory(session)
        first = queries.fleet_page(session, platform, queries.FleetFilter(), {}, page_size=1)
        second = queries.fleet_page(session, platform, queries.FleetFilter(page=2), {}, page_size=1)
        h100 = queries.fleet_page(session, platform, queries.FleetFilter(model="10de:2330"), {})
    assert (first.matching, first.pages, [r.name for r in first.rows]) == (2, 2, [HGX])
    assert [r.name for r in second.rows] == [L40S]
    assert [r.name for r in h100.rows] == [HGX]
    nodes = [dash.api("GET", f"/nodes/{n}").json() for n in (HGX, L40S)]  # type: ignore[attr-defined]
    assert first.gpus_total == sum(len(n["gpus"]) for n in nodes) == 12
    assert first.gpus_by_mode == {"accel": 8, "vgpu": 4, "passthrough": 0, "none": 0}
    assert first.hosts_by_mode["accel"] == first.hosts_by_mode["vgpu"] == 1
    assert [m for m, _ in first.models] == ["10de:2330", "10de:26b9"]
    cards = dash.api("GET", "/cards").json()  # type: ignore[attr-defined]
    assert first.cards_by_status["free"] == len(cards)
    assert sum(first.rows[0].cards.values()) == len([c for c in cards if c["node"] == HGX])


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
    assert [a["status_code"] for a in audit if a["action"] != "POST /ui/login"] == [403, 403]


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


def test_a_gpu_that_offers_no_card_is_found_by_model_and_counted(dash: Dash) -> None:
    """A T4 host in mode ``none`` offers no card: the model filter and the GPU totals still see it."""
    t4 = dash.join_fixture("t4-mdev")
    assert not [c for c in dash.api("GET", "/cards").json() if c["node"] == t4]  # type: ignore[attr-defined]
    dash.sign_in(dash.token("viewer", "vic"))
    html = dash.client.get("/ui/", params={"model": "10de:1eb8"}).text
    assert f'tr data-host="{t4}"' in html and HGX not in html.split('id="fleet"')[1]
    assert '<option value="10de:1eb8" >10de:1eb8 · ' in html.replace("selected", "")
    totals = html.split('id="gpu-totals"')[1].split("</div></div>")[0]
    assert '<div class="num">16</div>' in totals and 'data-mode="none">none 4<' in totals


def _group(dash: Dash, name: str, nodes: list[str]) -> None:
    r = dash.api("PUT", f"/groups/{name}", json={"nodes": nodes})
    assert r.status_code == 200, r.text  # type: ignore[attr-defined]


def _rollouts(dash: Dash) -> list[dict[str, object]]:
    found: list[dict[str, object]] = dash.api("GET", "/rollouts").json()  # type: ignore[attr-defined]
    return found


ROLLOUT = {
    "group": "gpu-a", "mode": "passthrough", "vm_policy": "all", "concurrency": "1", "max_failures": "0"
}  # fmt: skip


def _dry_run(dash: Dash, status: int = 200) -> dict[str, object]:
    r = dash.api("POST", "/groups/gpu-a/switch", params={"dry_run": "true"},
                 json={"mode": "passthrough", "vm_policy": "all"})  # type: ignore[attr-defined]  # fmt: skip
    assert r.status_code == status, r.text  # type: ignore[attr-defined]
    found: dict[str, object] = r.json()  # type: ignore[attr-defined]
    return found


def _rows(html: str) -> dict[str, str]:
    """The preview's member rows by host."""
    return dict(re.findall(r'<tr data-node="([^"]+)"[^>]*>(.*?)</tr>', html, re.S))


def _matches_api(html: str, plans: dict[str, dict[str, list[object]]]) -> None:
    for name, row in _rows(html).items():
        assert f'<td class="num">{len(plans[name]["steps"])}</td>' in row, name


def test_rollout_preview_shows_each_hosts_plan_then_confirm_starts_it(dash: Dash) -> None:
    _group(dash, "gpu-a", [HGX, L40S])
    dash.sign_in(dash.token("operator", "olga"))
    form = dash.client.get("/ui/rollouts/new", params={"group": "gpu-a"})
    assert form.status_code == 200 and '<option value="gpu-a" selected>gpu-a (2 hosts)' in form.text
    csrf = dash.csrf("/ui/rollouts")
    preview = dash.client.post("/ui/rollouts/preview", data={"csrf": csrf, **ROLLOUT})
    assert preview.status_code == 200, preview.text
    dry = _dry_run(dash)
    assert set(_rows(preview.text)) == set(dry["plans"]) == {HGX, L40S}  # type: ignore[call-overload]
    _matches_api(preview.text, dry["plans"])  # type: ignore[arg-type]
    figures = preview.text.split('id="group-figures"')[1].split("</section>")[0]
    assert '<div class="num">2</div><div class="lbl">hosts</div>' in figures  # from SQL, not the plans
    assert 'data-gpu-mode="accel">accel 8<' in figures and 'data-gpu-mode="vgpu">vgpu 4<' in figures
    assert 'id="preview-pager"' not in preview.text and 'id="confirm" disabled' not in preview.text
    assert _rollouts(dash) == [] and _jobs(dash) == []  # a preview stores nothing

    r = dash.client.post("/ui/rollouts", data={"csrf": csrf, **ROLLOUT}, follow_redirects=False)
    assert r.status_code == 303
    rollout = _rollouts(dash)[0]
    assert r.headers["location"] == f"/ui/rollouts/{rollout['id']}"
    assert rollout["created_by"] == "olga" and rollout["concurrency"] == 1
    first = _jobs(dash)
    assert [j["node"] for j in first] == [HGX] and first[0]["rollout"] == rollout["id"]  # one at a time
    page = dash.client.get(r.headers["location"]).text
    assert f'<a href="/ui/jobs/{first[0]["id"]}">job {first[0]["id"]}</a>' in page
    assert "rollout.js" in page and 'data-active="yes"' in page
    listing = dash.client.get("/ui/rollouts").text
    assert f'<tr data-rollout="{rollout["id"]}">' in listing and 'id="new-rollout"' in listing


def test_rollout_page_follows_the_jobs_live_until_the_rollout_ends(dash: Dash) -> None:
    _group(dash, "gpu-a", [HGX])
    dash.sign_in(dash.admin)
    csrf = dash.csrf("/ui/rollouts")
    r = dash.client.post("/ui/rollouts", data={"csrf": csrf, **ROLLOUT}, follow_redirects=False)
    rollout_id = r.headers["location"].rsplit("/", 1)[1]
    job_id = _jobs(dash)[0]["id"]
    dash.client.post(f"/ui/jobs/{job_id}/cancel", data={"csrf": csrf})  # the job ends: the rollout fails
    with dash.client.stream("GET", f"/ui/rollouts/{rollout_id}/stream") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        body = "".join(stream.iter_text())
    view = json.loads(body.split("data: ", 1)[1].split("\n", 1)[0])
    assert view["state"] == "failed" and view["active"] is False and view["failures"] == 1
    assert [(n["node"], n["job"], n["state"]) for n in view["nodes"]] == [(HGX, job_id, "cancelled")]
    assert view["counts"] == {"succeeded": 0, "active": 0, "pending": 0, "failed": 1}
    api = dash.api("GET", f"/rollouts/{rollout_id}").json()  # type: ignore[attr-defined]
    assert (view["nodes"], view["failures"]) == (api["nodes"], api["failures"])  # the page reads as the API
    assert "event: end" in body
    page = dash.client.get(f"/ui/rollouts/{rollout_id}").text
    assert 'data-active="no"' in page and 'data-count="failed">1<' in page
    assert dash.client.get("/ui/rollouts/999").status_code == 404


def test_rollout_preview_plans_one_page_at_a_time(dash: Dash, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web_rollouts, "PREVIEW_PAGE", 1)  # two members, two pages
    _group(dash, "gpu-a", [HGX, L40S])
    dash.sign_in(dash.token("operator", "olga"))
    csrf = dash.csrf("/ui/rollouts")
    plans = _dry_run(dash)["plans"]
    seen = []
    for page_no in ("1", "2", "99", "0", "x"):  # past the end: the last page; nonsense: the first
        r = dash.client.post("/ui/rollouts/preview", data={"csrf": csrf, **ROLLOUT, "page": page_no})
        assert r.status_code == 200, r.text
        shown = min(int(page_no), 2) if page_no.isdigit() and page_no != "0" else 1
        assert f"page {shown} of 2" in r.text
        assert '<div class="num">2</div><div class="lbl">hosts</div>' in r.text  # the whole group's figure
        _matches_api(r.text, plans)  # type: ignore[arg-type]
        seen.append(list(_rows(r.text)))
    assert seen == [[HGX], [L40S], [L40S], [HGX], [HGX]]
    first = dash.client.post("/ui/rollouts/preview", data={"csrf": csrf, **ROLLOUT}).text
    pager = first.split('id="preview-pager"')[1].split("</nav>")[0]
    assert 'name="page" value="2"' in pager and 'id="next-page"' in pager and 'id="prev-page"' not in pager
    assert f'name="csrf" value="{csrf}"' in pager and 'name="mode" value="passthrough"' in pager
    assert _rollouts(dash) == [] and _jobs(dash) == []


def test_a_refused_rollout_names_the_hosts_and_stores_nothing(dash: Dash) -> None:
    _group(dash, "gpu-a", [HGX, L40S])
    dash.sign_in(dash.token("operator", "olga"))
    csrf = dash.csrf("/ui/rollouts")
    bad = {**ROLLOUT, "mode": "vgpu", "vgpu_type": "NVIDIA H100XM-20C"}  # an H100 type: no L40S offers it
    r = dash.client.post("/ui/rollouts/preview", data={"csrf": csrf, **bad})
    assert r.status_code == 422 and f'<tr data-node="{L40S}" class="refused">' in r.text
    assert "may not be switched: " in _rows(r.text)[L40S] and 'id="confirm" disabled' in r.text
    r = dash.client.post("/ui/rollouts", data={"csrf": csrf, **bad})  # confirmed anyway: all members planned
    assert r.status_code == 422 and "1 of 2 hosts may not be switched" in r.text
    refused = r.text.split('id="refused"')[1].split("</ul>")[0]
    assert f">{L40S}</a>: " in refused and HGX not in refused
    r = dash.client.post("/ui/rollouts", data={"csrf": csrf, **ROLLOUT, "group": "nope"})
    assert r.status_code == 422 and "no host group named" in r.text
    r = dash.client.post("/ui/rollouts", data={"csrf": csrf, **ROLLOUT, "concurrency": "0"})
    assert r.status_code == 422 and "concurrency" in r.text
    assert _rollouts(dash) == [] and _jobs(dash) == []


def test_rollout_preview_names_whitelist_refusals_beyond_its_page(
    dash: Dash, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(web_rollouts, "PREVIEW_PAGE", 1)  # the page shows the H100 host only
    _group(dash, "gpu-a", [HGX, L40S])
    rules = {"models": {"10de:26b9": ["accel", "vgpu"]}}  # no passthrough on the L40S
    assert dash.api("PUT", "/modes", json=rules).status_code == 200  # type: ignore[attr-defined]
    dash.sign_in(dash.token("operator", "olga"))
    csrf = dash.csrf("/ui/rollouts")
    r = dash.client.post("/ui/rollouts/preview", data={"csrf": csrf, **ROLLOUT})
    assert r.status_code == 422 and list(_rows(r.text)) == [HGX]
    refused = r.text.split('id="whitelist-refused"')[1].split("</div>")[0]
    assert f">{L40S}</a>: disabled for GPU model 10de:26b9" in refused and HGX not in refused
    assert 'id="confirm" disabled' in r.text
    dry = _dry_run(dash, 422)  # the API refuses the same member
    assert L40S in str(dry) and "disabled for GPU model 10de:26b9" in str(dry)
    r = dash.client.post("/ui/rollouts", data={"csrf": csrf, **ROLLOUT})
    assert r.status_code == 422 and f">{L40S}</a>: " in r.text.split('id="refused"')[1]
    assert _rollouts(dash) == [] and _jobs(dash) == []


def test_viewer_sees_no_rollout_button_and_gets_403_when_posting(dash: Dash) -> None:
    _group(dash, "gpu-a", [HGX])
    dash.sign_in(dash.token("viewer", "vic"))
    listing = dash.client.get("/ui/rollouts")
    assert listing.status_code == 200 and 'id="new-rollout"' not in listing.text
    assert 'id="rollout-group"' not in dash.client.get("/ui/", params={"group": "gpu-a"}).text
    assert dash.client.get("/ui/rollouts/new").status_code == 403
    csrf = dash.csrf("/ui/rollouts")
    for path in ("/ui/rollouts/preview", "/ui/rollouts"):
        r = dash.client.post(path, data={"csrf": csrf, **ROLLOUT})
        assert r.status_code == 403 and "operator role" in r.text
    dash.sign_in(dash.token("operator", "olga"))
    assert dash.client.post("/ui/rollouts", data=ROLLOUT).status_code == 403  # no CSRF token
    assert _rollouts(dash) == [] and _jobs(dash) == []
    audit = dash.api("GET", "/audit", params={"actor": "vic"}).json()  # type: ignore[attr-defined]
    assert [a["status_code"] for a in audit if a["action"] != "POST /ui/login"] == [403, 403]


def test_the_audit_log_shows_people_only_on_request(dash: Dash) -> None:
    dash.token("viewer", "vic")  # a person's action, beside the agents' joins of the seed
    everyone = dash.api("GET", "/audit").json()  # type: ignore[attr-defined]
    people = dash.api("GET", "/audit", params={"people": "true"}).json()  # type: ignore[attr-defined]
    assert any(a["role"] not in ("viewer", "operator", "admin") for a in everyone)  # the joins
    assert people and {a["role"] for a in people} <= {"viewer", "operator", "admin"}
    humans = ("viewer", "operator", "admin")
    assert [a["id"] for a in people] == [a["id"] for a in everyone if a["role"] in humans]
    dash.sign_in(dash.admin)
    page = dash.client.get("/ui/audit", params={"people": "1"}).text
    assert "POST /api/v1/tokens" in page and "agents/join" not in page
    assert 'name="people" value="1" checked' in page
    assert "agents/join" in dash.client.get("/ui/audit").text


def test_the_job_page_has_an_overall_progress_bar(dash: Dash) -> None:
    dash.sign_in(dash.admin)
    csrf = dash.csrf()
    dash.client.post(f"/ui/nodes/{HGX}/switch", data={"csrf": csrf, **PLAN})
    job = _jobs(dash)[0]
    html = dash.client.get(f"/ui/jobs/{job['id']}").text
    total = len(job["steps"])
    assert f'aria-valuemax="{total}" aria-valuenow="0"' in html
    assert f"0 of {total} steps · 0%" in html
    with dash.client.stream("GET", f"/ui/jobs/{job['id']}/stream") as stream:
        first = json.loads(next(stream.iter_text()).split("data: ", 1)[1].split("\n", 1)[0])
    assert first["job"]["progress"] == {"finished": 0, "total": total, "percent": 0, "current": None}


def test_a_host_without_gpus_says_why_no_mode_is_allowed_and_disables_preview(dash: Dash) -> None:
    from gpumode.emulated.create import create_host
    from gpumode.emulated.fixtures import get_fixture
    from gpumode.host.discover import discover

    snapshot = discover(create_host(get_fixture("t4-mdev"), dash.tmp / "t4"))
    snapshot.hostname, snapshot.gpus = "cpu-only-01", []
    snapshot.fingerprint = snapshot.compute_fingerprint()
    body = snapshot.to_dict()
    r = dash.client.post(
        "/api/v1/agents/join",
        headers={"Authorization": f"Bearer {dash.join}"},
        json={"hostname": "cpu-only-01", "snapshot": body},
    )
    assert r.status_code == 201, r.text
    dash.sign_in(dash.admin)
    html = dash.client.get("/ui/nodes/cpu-only-01/switch").text
    assert 'id="no-gpus"' in html and "reported no NVIDIA GPU" in html
    assert re.search(r'<button type="submit" class="primary" id="preview" disabled>', html)
    assert "not allowed: cpu-only-01 reported no NVIDIA GPU" in html  # each mode says why
    html = dash.client.get(f"/ui/nodes/{HGX}/switch").text  # a host with GPUs: Preview stays enabled
    assert 'id="no-gpus"' not in html and 'id="preview" >' in html
