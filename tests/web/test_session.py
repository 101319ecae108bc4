"""Sign-in: the cookie's flags and contents, the loopback rule for plain HTTP, forged and revoked sessions."""

from __future__ import annotations

from fastapi.testclient import TestClient

from gpumode.server.app import create_app
from gpumode.server.bootstrap import initialise
from gpumode.server.settings import Settings
from gpumode.server.web.session import COOKIE

from .support import Dash


def test_unauthenticated_pages_redirect_to_sign_in(dash: Dash) -> None:
    r = dash.client.get("/ui/", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    assert dash.client.get("/ui/login").status_code == 200


def test_sign_in_sets_an_http_only_strict_cookie_without_the_token(dash: Dash) -> None:
    r = dash.client.post("/ui/login", data={"token": dash.admin}, follow_redirects=False)
    assert r.status_code == 303
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Secure" not in cookie  # plain HTTP on loopback: the documented exception
    assert dash.admin not in cookie and dash.admin.split("_", 1)[1] not in cookie
    assert ">admin<" in dash.client.get("/ui/").text  # the admin token's name is shown


def test_a_wrong_or_node_token_is_refused(dash: Dash) -> None:
    r = dash.client.post("/ui/login", data={"token": "gpmu_nope"}, follow_redirects=False)
    assert r.status_code == 401 and "unknown or revoked token" in r.text
    assert COOKIE not in r.headers.get("set-cookie", "")
    r = dash.client.post("/ui/login", data={"token": dash.join}, follow_redirects=False)
    assert r.status_code == 401


def test_https_cookie_is_secure(tmp_path: object) -> None:
    from pathlib import Path

    settings = Settings(db=str(Path(str(tmp_path)) / "g.db"))
    creds = initialise(settings)
    with TestClient(create_app(settings), base_url="https://dash.example", client=("10.1.2.3", 5)) as client:
        r = client.post("/ui/login", data={"token": creds.admin_token}, follow_redirects=False)
        assert r.status_code == 303
        assert "Secure" in r.headers["set-cookie"]


def test_plain_http_from_the_network_is_refused(tmp_path: object) -> None:
    from pathlib import Path

    settings = Settings(db=str(Path(str(tmp_path)) / "g.db"))
    creds = initialise(settings)
    with TestClient(create_app(settings), client=("10.1.2.3", 5)) as client:
        r = client.post("/ui/login", data={"token": creds.admin_token}, follow_redirects=False)
        assert r.status_code == 403 and "HTTPS" in r.text
        assert COOKIE not in r.headers.get("set-cookie", "")


def test_a_forged_or_tampered_cookie_is_not_a_session(dash: Dash) -> None:
    dash.sign_in(dash.admin)
    good = dash.client.cookies[COOKIE]
    token_id, expiry, nonce, mac = good.split(".")
    longer = f"{token_id}.{int(expiry) + 1000}.{nonce}.{mac}"
    for bad in (longer, f"{token_id}.{expiry}.{nonce}.{mac[:-2]}xx", "1"):
        dash.client.cookies.set(COOKIE, bad)
        assert dash.client.get("/ui/", follow_redirects=False).status_code == 303


def test_revoking_the_token_ends_its_sessions(dash: Dash) -> None:
    viewer = dash.token("viewer", "vic")
    dash.sign_in(viewer)
    assert dash.client.get("/ui/", follow_redirects=False).status_code == 200
    tokens = dash.api("GET", "/tokens").json()  # type: ignore[attr-defined]
    vic = next(t for t in tokens if t["name"] == "vic")
    assert dash.api("DELETE", f"/tokens/{vic['id']}").status_code in (200, 204)  # type: ignore[attr-defined]
    assert dash.client.get("/ui/", follow_redirects=False).status_code == 303


def test_sign_out_needs_csrf_and_clears_the_cookie(dash: Dash) -> None:
    dash.sign_in(dash.admin)
    assert dash.client.post("/ui/logout", data={}).status_code == 403
    r = dash.client.post("/ui/logout", data={"csrf": dash.csrf()}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    assert f'{COOKIE}=""' in r.headers["set-cookie"] or "Max-Age=0" in r.headers["set-cookie"]
