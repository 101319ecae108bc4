"""Bad snapshots are refused with a clear 4xx and leave nothing behind; no input turns into a 5xx."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from gpumode.domain import SNAPSHOT_SCHEMA

from .builders import host
from .conftest import Api


def _state(api: Api) -> tuple[Any, ...]:
    node = api.get("/nodes/n1").json()
    return node["fingerprint"], len(api.cards()), len(api.events())


def _mutations() -> list[tuple[str, Any]]:
    return [
        ("wrong schema", lambda d: d.update(schema="gpumode.snapshot/v0")),
        ("unknown key", lambda d: d.update(surprise=1)),
        ("missing gpus", lambda d: d.pop("gpus")),
        ("bad address", lambda d: d["gpus"][0].update(address="zz:00.0")),
        ("short address", lambda d: d["functions"][0].update(address="1b:00.0")),
        ("vendor out of range", lambda d: d["functions"][0].update(vendor=0x1FFFF)),
        ("string for int", lambda d: d["functions"][0].update(device="2330")),
        ("unknown mode", lambda d: d["gpus"][0].update(mode="turbo")),
        ("gpu without function", lambda d: d["functions"].pop(0)),
        ("duplicate function", lambda d: d["functions"].append(copy.deepcopy(d["functions"][0]))),
        ("wrong fingerprint", lambda d: d.update(fingerprint="sha256:" + "0" * 64)),
        ("malformed fingerprint", lambda d: d.update(fingerprint="md5:abc")),
        ("hostname for another node", lambda d: d.update(hostname="n2")),
        ("list instead of object", lambda d: d["gpus"][0].update(companions={"a": 1})),
        ("null nvidia", lambda d: d.update(nvidia=None)),
        (
            "bad vgpu keys",
            lambda d: d["functions"][0].update(vendor_vgpu={"creatable": {"x": "y"}, "current": 0}),
        ),
    ]


@pytest.mark.parametrize(("label", "mutate"), _mutations(), ids=[m[0] for m in _mutations()])
def test_malformed_snapshot_is_422_and_nothing_changes(api: Api, label: str, mutate: Any) -> None:
    token = api.join("n1")
    before = _state(api)
    body = host("n1", gpus=1).to_dict()  # a real change, if it were accepted
    mutate(body)
    r = api.report("n1", token, body)
    assert r.status_code == 422, (label, r.status_code, r.text)
    assert r.json()["detail"], label
    assert _state(api) == before


def test_schema_error_names_the_problem(api: Api) -> None:
    token = api.join("n1")
    body = host("n1").to_dict()
    body["schema"] = "gpumode.snapshot/v9"
    detail = json.dumps(api.report("n1", token, body).json())
    assert "unsupported snapshot schema" in detail and SNAPSHOT_SCHEMA in detail


def test_not_json_is_422(api: Api) -> None:
    token = api.join("n1")
    for raw in (b"{", b"\xff\xfe", b"[]", b"null", b'"x"'):
        r = api.client.post(
            "/api/v1/nodes/n1/report",
            content=raw,
            headers={**api.headers(token), "Content-Type": "application/json"},
        )
        assert r.status_code == 422, (raw, r.status_code)


def test_oversized_body_is_413_and_nothing_changes(api: Api) -> None:
    token = api.join("n1")
    before = _state(api)
    body = host("n1", gpus=1).to_dict()
    body["problems"] = ["x" * 2000] * 200  # ~400 KB > the 256 KiB limit of the test settings
    r = api.report("n1", token, body)
    assert r.status_code == 413 and "larger than" in r.json()["detail"]
    assert _state(api) == before


def test_oversized_chunked_body_is_413(api: Api) -> None:
    token = api.join("n1")

    def chunks() -> Any:
        for _ in range(100):
            yield b" " * 8192  # no Content-Length: the limit is enforced while reading

    r = api.client.post(
        "/api/v1/nodes/n1/report",
        content=chunks(),
        headers={**api.headers(token), "Content-Type": "application/json"},
    )
    assert r.status_code == 413


def test_report_for_unknown_node_is_404(api: Api) -> None:
    r = api.report("ghost", api.admin, host("ghost").to_dict())
    assert r.status_code == 404 and "join" in r.json()["detail"]


def test_missing_fingerprint_is_computed(api: Api) -> None:
    token = api.join("n1")
    snap = host("n1", gpus=1)
    body = snap.to_dict()
    body["fingerprint"] = ""
    r = api.report("n1", token, body)
    assert r.status_code == 200 and r.json()["fingerprint"] == snap.fingerprint


def test_random_garbage_never_5xx(api: Api) -> None:
    token = api.join("n1")
    base = host("n1").to_dict()
    odd_values: list[Any] = [None, -1, 2**70, "", "x" * 600, [], {}, 1.5, True, {"a": [1]}]
    for path in (
        ("kernel",),
        ("gpus", 0, "numa_node"),
        ("functions", 0, "sriov"),
        ("nvidia", "services"),
        ("modules",),
        ("functions", 0, "mdevs"),
        ("gpus", 0, "mdevs"),
        ("driver_state",),
    ):
        for value in odd_values:
            body = copy.deepcopy(base)
            target: Any = body
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value
            r = api.report("n1", token, body)
            assert r.status_code < 500, (path, value, r.text)
