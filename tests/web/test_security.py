"""The dashboard's share of #16: an admin allows a node's replacement; signing out ends the session."""

from __future__ import annotations

from typing import Any

from .support import Dash


def _first_node(dash: Dash) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = dash.api("GET", "/nodes").json()  # type: ignore[attr-defined]
    return nodes[0]


def test_an_admin_allows_a_replacement_from_the_host_page(dash: Dash) -> None:
    name = _first_node(dash)["name"]
    operator = dash.token("operator", "op")
    dash.sign_in(operator)
    assert 'id="replace"' not in dash.client.get(f"/ui/nodes/{name}").text
    r = dash.client.post(f"/ui/nodes/{name}/replace", data={"csrf": dash.csrf()}, follow_redirects=False)
    assert r.status_code == 403
    dash.sign_in(dash.admin)
    assert 'id="replace"' in dash.client.get(f"/ui/nodes/{name}").text
    assert dash.client.post(f"/ui/nodes/{name}/replace", data={}).status_code == 403  # no CSRF token
    r = dash.client.post(f"/ui/nodes/{name}/replace", data={"csrf": dash.csrf()}, follow_redirects=False)
    assert r.status_code == 303, r.text
    assert 'id="replace-pending"' in dash.client.get(f"/ui/nodes/{name}").text
    r = dash.client.post("/ui/nodes/ghost/replace", data={"csrf": dash.csrf()}, follow_redirects=False)
    assert r.status_code == 404
    audit: list[dict[str, Any]] = dash.api("GET", "/audit").json()  # type: ignore[attr-defined]
    action = "POST /ui/nodes/{name}/replace"
    done = [e for e in audit if e["action"] == action and e["target"] == f"node:{name}"]
    assert len(done) == 1 and done[0]["actor"] == "admin"
