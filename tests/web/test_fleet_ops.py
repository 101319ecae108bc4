"""Host groups and lost cards on the dashboard: operators create groups, move hosts in and out, delete them,
and release a lost card from its host's page; viewers only look."""

from __future__ import annotations

from gpumode.cloud.base import CardStatus
from gpumode.cloud.embedded import EmbeddedPlatform
from gpumode.server import db

from .support import HGX, L40S, Dash, dash, seed

__all__ = ["dash", "seed"]


def _groups(dash: Dash) -> list[dict[str, object]]:
    found: list[dict[str, object]] = dash.api("GET", "/groups").json()  # type: ignore[attr-defined]
    return found


def _post(dash: Dash, **fields: str) -> object:
    data = {"csrf": dash.csrf("/ui/groups"), **fields}
    return dash.client.post("/ui/groups", data=data, follow_redirects=False)


def test_operators_manage_host_groups(dash: Dash) -> None:
    dash.sign_in(dash.token("operator", "olga"))
    assert "No host groups yet." in dash.client.get("/ui/groups").text
    assert _post(dash, action="create", group="rack-a").status_code == 303  # type: ignore[attr-defined]
    assert _post(dash, action="assign", group="rack-a", node=HGX).status_code == 303  # type: ignore[attr-defined]
    assert _post(dash, action="assign", group="rack-a", node=L40S).status_code == 303  # type: ignore[attr-defined]
    assert _groups(dash) == [{"name": "rack-a", "nodes": sorted([HGX, L40S])}]
    again = _post(dash, action="create", group="rack-a")
    assert again.status_code == 409 and "host group &#39;rack-a&#39; exists" in again.text  # type: ignore[attr-defined]
    unknown = _post(dash, action="assign", group="rack-a", node="nowhere")
    assert unknown.status_code == 422 and "unknown node(s): nowhere" in unknown.text  # type: ignore[attr-defined]
    assert _post(dash, action="remove", group="rack-a", node=HGX).status_code == 303  # type: ignore[attr-defined]
    assert _groups(dash) == [{"name": "rack-a", "nodes": [L40S]}]
    page = dash.client.get("/ui/groups").text
    assert 'data-group="rack-a"' in page and "/ui/rollouts/new?group=rack-a" in page
    assert _post(dash, action="delete", group="rack-a").status_code == 303  # type: ignore[attr-defined]
    assert _groups(dash) == []
    audit = dash.api("GET", "/audit", params={"actor": "olga"}).json()  # type: ignore[attr-defined]
    assert [a["target"] for a in audit][:2] == ["group:rack-a", "group:rack-a"]


def test_viewers_see_groups_but_cannot_change_them(dash: Dash) -> None:
    dash.api("PUT", "/groups/rack-b", json={"nodes": [HGX]})
    dash.sign_in(dash.token("viewer", "vic"))
    page = dash.client.get("/ui/groups").text
    assert HGX in page and "Create group" not in page
    r = _post(dash, action="delete", group="rack-b")
    assert r.status_code == 403 and _groups(dash)  # type: ignore[attr-defined] == [{"name": "rack-b", "nodes": [HGX]}]


def test_a_lost_card_is_released_from_its_host_page(dash: Dash) -> None:
    engine = db.make_engine(str(dash.tmp / "gpumode.db"))
    with db.make_sessionmaker(engine).begin() as session:
        platform = EmbeddedPlatform(session)
        card = platform.list_cards(node=HGX)[0]
        # what hardware sync does when a held card's device vanishes (tested end to end in tests/cli)
        platform.update_card(card.id, status=CardStatus.LOST, holder="vm-7")
    engine.dispose()
    dash.sign_in(dash.token("operator", "olga"))
    page = dash.client.get(f"/ui/nodes/{HGX}").text
    assert 'id="lost-cards"' in page and f'action="/ui/cards/{card.id}/release"' in page and "vm-7" in page
    csrf = dash.csrf(f"/ui/nodes/{HGX}")
    r = dash.client.post(f"/ui/cards/{card.id}/release", data={"csrf": csrf}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/ui/nodes/{HGX}"
    cards = dash.api("GET", "/cards", params={"node": HGX}).json()  # type: ignore[attr-defined]
    assert card.id not in [c["id"] for c in cards]
    assert 'id="lost-cards"' not in dash.client.get(f"/ui/nodes/{HGX}").text
    again = dash.client.post(f"/ui/cards/{card.id}/release", data={"csrf": csrf})
    assert again.status_code == 409


def test_the_host_page_marks_an_out_of_date_agent(dash: Dash) -> None:
    from gpumode.emulated.create import create_host
    from gpumode.emulated.fixtures import get_fixture
    from gpumode.host.discover import discover

    snapshot = discover(create_host(get_fixture("rtx-workstation"), dash.tmp / "ws"))
    body = {"hostname": snapshot.hostname, "snapshot": snapshot.to_dict()}
    join = {"Authorization": f"Bearer {dash.join}"}
    joined = dash.client.post("/api/v1/agents/join", headers=join, json=body)
    node = {"Authorization": f"Bearer {joined.json()['token']}"}
    host_page = f"/ui/nodes/{snapshot.hostname}"
    dash.sign_in(dash.admin)
    assert 'id="agent-version"' not in dash.client.get(host_page).text  # not heard from yet
    # a gpumode 0.1.0 agent asks for work: it sends no protocol header
    work = f"/api/v1/nodes/{snapshot.hostname}/work"
    assert dash.client.get(work, params={"wait": 0}, headers=node).status_code == 204
    marked = '<span id="agent-version">0.1.0 <span class="sev sev-warning">out of date: upgrade it</span>'
    assert marked in dash.client.get(host_page).text
