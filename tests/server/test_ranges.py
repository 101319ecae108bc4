"""Every integer a route reads from its path or query is range-checked before the database sees it (#16).

The routes are read from the app itself, API and dashboard alike, so a route added later is covered without
naming it here: each integer parameter must declare an upper bound, and numbers past both databases' integer
ranges (PostgreSQL's 32-bit INTEGER, SQLite's 64-bit) must answer 404 or 422, never 500.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, iter_route_contexts
from pydantic.fields import FieldInfo

from gpumode.server.web.session import COOKIE

from .conftest import Api

BIG = (2**31, 2**63, 10**30)


@dataclass(frozen=True)
class IntParam:
    method: str
    path: str  # with {placeholders}
    name: str
    where: str  # "path" | "query"
    field: FieldInfo


def _integer(field: FieldInfo) -> bool:
    annotation = field.annotation
    return annotation is int or (getattr(annotation, "__args__", None) or ()) in ((int, type(None)),)


def _upper_bound(field: FieldInfo) -> int | None:
    for item in field.metadata:
        bound = getattr(item, "le", None)
        if bound is not None:
            return int(bound)
    return None


def _params(dependant: Dependant, where: str) -> list[Any]:
    """The route's own parameters and those of its dependencies, all the way down."""
    own = list(dependant.path_params if where == "path" else dependant.query_params)
    return own + [p for sub in dependant.dependencies for p in _params(sub, where)]


def integer_params(app: Any) -> list[IntParam]:
    found = []
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if not isinstance(route, APIRoute):
            continue
        for where in ("path", "query"):
            for param in _params(route.dependant, where):
                if _integer(param.field_info):
                    for method in sorted(context.methods or ()):
                        found.append(IntParam(method, context.path, param.alias, where, param.field_info))
    return found


def _url(param: IntParam, value: int) -> str:
    def fill(match: re.Match[str]) -> str:
        return str(value) if match.group(1) == param.name else ("1" if "id" in match.group(1) else "n1")

    path = re.sub(r"\{(\w+)(?::\w+)?\}", fill, param.path)
    return path + (f"?{param.name}={value}" if param.where == "query" else "")


def test_every_integer_parameter_has_an_upper_bound(api: Api) -> None:
    params = integer_params(api.client.app)
    # the generator sees the routes the issue was about, API and dashboard
    paths = {p.path for p in params}
    expected = {"/api/v1/jobs/{job_id}", "/api/v1/cards/{card_id}"}
    expected |= {"/ui/jobs/{job_id}", "/ui/rollouts/{rollout_id}"}
    assert expected <= paths
    unbounded = [(p.method, p.path, p.name) for p in params if _upper_bound(p.field) is None]
    assert unbounded == []
    too_wide = [(p.path, p.name) for p in params if (_upper_bound(p.field) or 0) >= 2**31]
    assert too_wide == []


def test_big_integers_answer_404_or_422_on_every_route(api: Api) -> None:
    app = api.client.app
    with app.state.gpumode.sessions() as session:  # type: ignore[attr-defined]
        cookie = app.state.gpumode_web_keys.sign_in(session, api.admin).cookie  # type: ignore[attr-defined]
        session.commit()
    api.client.cookies.set(COOKIE, cookie)
    node = api.join("n1")
    answers: dict[tuple[str, str, int], int] = {}
    for param in integer_params(app):
        token = node if param.path.endswith(("/work", "/jobs/{job_id}/events")) else api.admin
        for value in BIG:
            r = api.client.request(param.method, _url(param, value), headers=api.headers(token), json={})
            answers[(param.method, _url(param, value), value)] = r.status_code
    assert len(answers) >= 3 * 15
    wrong = {k: v for k, v in answers.items() if v not in (404, 422)}
    assert wrong == {}


def test_a_step_time_far_in_the_future_is_refused(api: Api) -> None:
    token = api.join("n1")
    for at in (1e300, 4.2e9, -1.0):
        body = {"steps": [{"step": "s", "state": "done", "at": at}]}
        r = api.call("POST", "/jobs/1/events", token, json=body)
        assert r.status_code == 422 and "at" in str(r.json()["detail"][0]["loc"]), (at, r.text)


def _integers(schema: Any, components: dict[str, Any], where: str, seen: set[str]) -> list[tuple[str, Any]]:
    """Every integer in a JSON schema (following $refs once each), with where it is."""
    if isinstance(schema, list):
        parts = [_integers(item, components, f"{where}[{n}]", seen) for n, item in enumerate(schema)]
        return [hit for part in parts for hit in part]
    if not isinstance(schema, dict):
        return []
    ref = schema.get("$ref")
    if isinstance(ref, str):
        name = ref.rsplit("/", 1)[-1]
        if name in seen:
            return []
        seen.add(name)
        return _integers(components[name], components, name, seen)
    found = [(where, schema)] if schema.get("type") == "integer" else []
    for key, value in schema.items():
        found += _integers(value, components, f"{where}.{key}", seen)
    return found


def test_every_integer_in_a_request_body_has_an_upper_bound(api: Api) -> None:
    spec = api.get("/openapi.json").json()
    components = spec["components"]["schemas"]
    bodies = [
        (f"{method.upper()} {path}", op["requestBody"]["content"]["application/json"]["schema"])
        for path, item in spec["paths"].items()
        for method, op in item.items()
        if "requestBody" in op
    ]
    assert len(bodies) >= 10
    integers = [hit for what, schema in bodies for hit in _integers(schema, components, what, set())]
    assert any("vgpu_count" in where for where, _ in integers)  # the walk reaches nested models
    unbounded = sorted({where for where, schema in integers if "maximum" not in schema})
    assert unbounded == []
