"""The dashboard's share of #16: an admin allows a node's replacement; signing out ends the session."""

from __future__ import annotations

import re
from typing import Any

from gpumode.server.web.session import COOKIE

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


def test_sign_out_ends_the_session_on_the_server(dash: Dash) -> None:
    dash.sign_in(dash.admin)
    cookie = dash.client.cookies[COOKIE]
    r = dash.client.post("/ui/logout", data={"csrf": dash.csrf()}, follow_redirects=False)
    assert r.status_code == 303
    dash.client.cookies.set(COOKIE, cookie)  # a copy of the old cookie, kept by a browser or a thief
    assert dash.client.get("/ui/", follow_redirects=False).status_code == 303  # back to sign-in
    assert dash.client.get("/ui/sessions", follow_redirects=False).status_code == 303
    audit: list[dict[str, Any]] = dash.api("GET", "/audit").json()  # type: ignore[attr-defined]
    assert {"signed in", "signed out"} <= {
        e["detail"] for e in audit if e["action"].startswith("POST /ui/log")
    }


def test_an_admin_lists_sessions_per_user_and_ends_one(dash: Dash) -> None:
    viewer = dash.token("viewer", "watcher")
    dash.sign_in(viewer)
    viewer_cookie = dash.client.cookies[COOKIE]
    assert dash.client.get("/ui/sessions").status_code == 403
    dash.sign_in(dash.admin)
    listing = dash.client.get("/ui/sessions").text
    assert "watcher" in listing and "this session" in listing
    ids = [int(x) for x in re.findall(r'id="end-(\d+)"', listing)]
    assert len(ids) == 1  # the viewer's; an admin's own session is ended by signing out
    r = dash.client.post(f"/ui/sessions/{ids[0]}/end", data={"csrf": dash.csrf()}, follow_redirects=False)
    assert r.status_code == 303
    assert "watcher" not in dash.client.get("/ui/sessions").text
    r = dash.client.post(f"/ui/sessions/{ids[0]}/end", data={"csrf": dash.csrf()}, follow_redirects=False)
    assert r.status_code == 404  # already ended
    admin_cookie = dash.client.cookies[COOKIE]
    dash.client.cookies.set(COOKIE, viewer_cookie)
    assert dash.client.get("/ui/", follow_redirects=False).status_code == 303
    dash.client.cookies.set(COOKIE, admin_cookie)
    assert dash.client.get("/ui/", follow_redirects=False).status_code == 200


def test_sessions_are_listed_and_ended_over_the_api_by_admins_only(dash: Dash) -> None:
    viewer = dash.token("viewer", "api-watcher")
    dash.sign_in(viewer)
    cookie = dash.client.cookies[COOKIE]
    assert dash.api("GET", "/sessions", viewer).status_code == 403  # type: ignore[attr-defined]
    listed = dash.api("GET", "/sessions").json()  # type: ignore[attr-defined]
    mine = [s for s in listed if s["user"] == "api-watcher"]
    assert len(mine) == 1 and mine[0]["role"] == "viewer"
    assert dash.api("DELETE", f"/sessions/{mine[0]['id']}").status_code == 204  # type: ignore[attr-defined]
    assert dash.api("DELETE", f"/sessions/{mine[0]['id']}").status_code == 404  # type: ignore[attr-defined]
    dash.client.cookies.set(COOKIE, cookie)
    assert dash.client.get("/ui/", follow_redirects=False).status_code == 303
