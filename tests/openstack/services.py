"""In-process OpenStack services for the tests: a REAL Placement (openstack-placement's WSGI app over SQLite,
``auth_strategy = noauth2``) and faithful fakes of the Nova compute API and Cyborg, all served over loopback
HTTP by threads, so every gpumode call is a real HTTP request."""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import httpx

Wsgi = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


class Served:
    """A WSGI app on a loopback port, served by a daemon thread."""

    def __init__(self, app: Wsgi) -> None:
        self.server: WSGIServer = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


HARNESS_HEADER = "X-Gpumode-Test-Harness"  # sent by PlacementAdmin (the tests and the nova-compute reporter)


class Faults:
    """Wraps Placement: while ``fail`` says so, a request gets ``status`` (503: Placement down behind its
    proxy; 500: Placement itself failing). ``spare_harness``: only gpumode's requests fail, the tests' own
    and nova-compute's (the reporter's) go through."""

    REASONS: ClassVar[dict[int, str]] = {500: "Internal Server Error", 503: "Service Unavailable"}

    def __init__(self, app: Wsgi) -> None:
        self.app = app
        self.fail: Callable[[str, str], bool] | None = None
        self.status = 503
        self.spare_harness = False
        self.seen: list[tuple[str, str]] = []

    def reset(self) -> None:
        self.fail, self.status, self.spare_harness = None, 503, False

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        self.seen.append((method, path))
        spared = self.spare_harness and "HTTP_X_GPUMODE_TEST_HARNESS" in environ
        if self.fail is not None and not spared and self.fail(method, path):
            reason = self.REASONS.get(self.status, "Error")
            start_response(f"{self.status} {reason}", [("Content-Type", "application/json")])
            body = {"errors": [{"status": self.status, "title": reason, "detail": "injected"}]}
            return [json.dumps(body).encode()]
        return self.app(environ, start_response)


def start_placement(directory: Path) -> tuple[Served, Faults]:
    """openstack-placement's own app: config, schema sync (alembic to head, traits and classes), noauth2."""
    from oslo_config import cfg
    from oslo_policy import opts as policy_opts
    from placement import conf as placement_conf
    from placement import db_api, deploy

    conf = cfg.ConfigOpts()
    placement_conf.register_opts(conf)
    conf.set_override("connection", f"sqlite:///{directory / 'placement.db'}", group="placement_database")
    conf.set_override("sync_on_startup", True, group="placement_database")
    conf.set_override("auth_strategy", "noauth2", group="api")
    conf([], default_config_files=[])
    policy_opts.set_defaults(conf, enforce_new_defaults=False)
    db_api.configure(conf)
    faults = Faults(deploy.loadapp(conf))
    return Served(faults), faults


class PlacementAdmin:
    """Direct HTTP to Placement for the tests' own setup and assertions (not gpumode's client)."""

    HEADERS: ClassVar[dict[str, str]] = {
        "X-Auth-Token": "admin",
        "OpenStack-API-Version": "placement 1.39",
        HARNESS_HEADER: "1",
    }

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, headers=self.HEADERS, timeout=10)

    def call(self, method: str, path: str, body: Any = None, ok: Iterable[int] = (200, 201, 204)) -> Any:
        resp = self.http.request(method, path, json=body)
        assert resp.status_code in tuple(ok), f"{method} {path}: {resp.status_code} {resp.text}"
        return resp.json() if resp.content else None

    def providers(self) -> dict[str, dict[str, Any]]:
        return {p["name"]: p for p in self.call("GET", "/resource_providers")["resource_providers"]}

    def traits(self, rp: str) -> set[str]:
        return set(self.call("GET", f"/resource_providers/{rp}/traits")["traits"])

    def aggregates(self, rp: str) -> set[str]:
        return set(self.call("GET", f"/resource_providers/{rp}/aggregates")["aggregates"])

    def inventories(self, rp: str) -> dict[str, int]:
        inv = self.call("GET", f"/resource_providers/{rp}/inventories")["inventories"]
        return {rc: v["total"] for rc, v in inv.items()}

    def allocate(self, consumer: str, rp: str, resources: dict[str, int]) -> None:
        body = {
            "allocations": {rp: {"resources": resources}},
            "project_id": str(uuid.uuid4()),
            "user_id": str(uuid.uuid4()),
            "consumer_generation": None,
            "consumer_type": "INSTANCE",
        }
        self.call("PUT", f"/allocations/{consumer}", body)

    def allocations(self, consumer: str) -> dict[str, Any]:
        result: dict[str, Any] = self.call("GET", f"/allocations/{consumer}")["allocations"]
        return result

    def wipe(self) -> None:
        """Empty Placement between tests: allocations first, then providers leaves-first."""
        for p in self.providers().values():
            for consumer in self.call("GET", f"/resource_providers/{p['uuid']}/allocations")["allocations"]:
                self.call("DELETE", f"/allocations/{consumer}", ok=(204, 404))
        while providers := self.providers():
            parents = {p["parent_provider_uuid"] for p in providers.values()}
            for p in providers.values():
                if p["uuid"] not in parents:
                    self.call("DELETE", f"/resource_providers/{p['uuid']}")


# --- Nova compute API ------------------------------------------------------------------------------------


@dataclass
class FakeServer:
    id: str
    name: str
    host: str
    status: str = "ACTIVE"
    extra_specs: dict[str, str] = field(default_factory=dict)


class FakeNova:
    """The compute API's request/response shapes for the calls gpumode makes (microversion 2.79): os-services
    by uuid, servers/detail filtered by host, server actions (202, state changes applied at once, as a fast
    compute would), os-aggregates with uuids. Every request is recorded."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, Any]] = {}
        self.servers: dict[str, FakeServer] = {}
        self.aggregates: dict[int, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.other_host = "compute-spare"
        self.fail_actions: set[str] = set()

    def add_service(self, host: str, *, status: str = "enabled", reason: str | None = None) -> str:
        sid = str(uuid.uuid4())
        self.services[sid] = {
            "id": sid,
            "binary": "nova-compute",
            "host": host,
            "zone": "nova",
            "status": status,
            "state": "up",
            "disabled_reason": reason,
            "forced_down": False,
            "updated_at": "2025-01-01T00:00:00Z",
        }
        return sid

    def add_server(self, name: str, host: str, extra_specs: dict[str, str] | None = None) -> FakeServer:
        server = FakeServer(str(uuid.uuid4()), name, host, extra_specs=dict(extra_specs or {}))
        self.servers[server.id] = server
        return server

    def _server_json(self, s: FakeServer) -> dict[str, Any]:
        return {
            "id": s.id,
            "name": s.name,
            "status": s.status,
            "OS-EXT-SRV-ATTR:host": s.host,
            "flavor": {
                "original_name": "gpu",
                "vcpus": 4,
                "ram": 8192,
                "disk": 40,
                "extra_specs": s.extra_specs,
            },
        }

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        query = dict(p.split("=", 1) for p in environ.get("QUERY_STRING", "").split("&") if "=" in p)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = json.loads(environ["wsgi.input"].read(length)) if length else None
        self.requests.append((method, path, body))
        status, data = self.route(method, path, query, body)
        start_response(f"{status} X", [("Content-Type", "application/json")])
        return [json.dumps(data).encode()] if data is not None else []

    def route(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if method == "GET" and path == "/os-services":
            found = [s for s in self.services.values() if s["host"] == query.get("host", s["host"])]
            return 200, {"services": found}
        if m := re.fullmatch(r"/os-services/([^/]+)", path):
            svc = self.services.get(m.group(1))
            if svc is None:
                return 404, {"itemNotFound": {"code": 404, "message": "Service not found"}}
            svc["status"] = body["status"]
            svc["disabled_reason"] = body.get("disabled_reason") if body["status"] == "disabled" else None
            return 200, {"service": svc}
        if method == "GET" and path == "/servers/detail":
            found = [s for s in self.servers.values() if s.host == query.get("host")]
            return 200, {"servers": [self._server_json(s) for s in found]}
        if m := re.fullmatch(r"/servers/([^/]+)", path):
            s = self.servers.get(m.group(1))
            if s is None:
                return 404, {"itemNotFound": {"code": 404, "message": "Instance could not be found"}}
            return 200, {"server": self._server_json(s)}
        if m := re.fullmatch(r"/servers/([^/]+)/action", path):
            return self.action(self.servers[m.group(1)], body)
        if method == "GET" and path == "/os-aggregates":
            return 200, {"aggregates": list(self.aggregates.values())}
        if method == "POST" and path == "/os-aggregates":
            agg_id = len(self.aggregates) + 1
            self.aggregates[agg_id] = {
                "id": agg_id,
                "name": body["aggregate"]["name"],
                "uuid": str(uuid.uuid4()),
                "hosts": [],
                "metadata": {},
                "availability_zone": None,
            }
            return 200, {"aggregate": self.aggregates[agg_id]}
        if m := re.fullmatch(r"/os-aggregates/(\d+)/action", path):
            agg = self.aggregates[int(m.group(1))]
            if "add_host" in body:
                if body["add_host"]["host"] in agg["hosts"]:
                    return 409, {"conflictingRequest": {"code": 409, "message": "host already in aggregate"}}
                agg["hosts"].append(body["add_host"]["host"])
            else:
                if body["remove_host"]["host"] not in agg["hosts"]:
                    return 404, {"itemNotFound": {"code": 404, "message": "host not in aggregate"}}
                agg["hosts"].remove(body["remove_host"]["host"])
            return 200, {"aggregate": agg}
        return 404, {"itemNotFound": {"code": 404, "message": f"no route {method} {path}"}}

    def action(self, s: FakeServer, body: dict[str, Any]) -> tuple[int, Any]:
        ((name, arg),) = body.items()
        if name in self.fail_actions:
            return 409, {"conflictingRequest": {"code": 409, "message": f"Cannot '{name}' instance {s.id}"}}
        allowed = {
            "os-stop": ({"ACTIVE"}, "SHUTOFF"),
            "os-start": ({"SHUTOFF"}, "ACTIVE"),
            "shelve": ({"ACTIVE", "SHUTOFF"}, "SHELVED_OFFLOADED"),
            "unshelve": ({"SHELVED_OFFLOADED"}, "ACTIVE"),
            "os-migrateLive": ({"ACTIVE"}, "ACTIVE"),
        }
        if name not in allowed:
            return 400, {"badRequest": {"code": 400, "message": f"unknown action {name}"}}
        if name == "os-migrateLive" and set(arg) != {"host", "block_migration"}:
            return 400, {"badRequest": {"code": 400, "message": "bad os-migrateLive body"}}
        sources, target = allowed[name]
        if s.status not in sources:
            return 409, {"conflictingRequest": {"code": 409, "message": f"Cannot '{name}' while {s.status}"}}
        s.status = target
        if name == "os-migrateLive":
            s.host = self.other_host
        return 202, None


class FakeCyborg:
    """``GET /v2/device_profiles`` as Cyborg answers it."""

    def __init__(self, profiles: list[dict[str, Any]]) -> None:
        self.profiles = profiles

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/v2/device_profiles":
            start_response("404 Not Found", [("Content-Type", "application/json")])
            return [b"{}"]
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps({"device_profiles": self.profiles}).encode()]
