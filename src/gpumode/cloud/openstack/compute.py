"""The Nova calls a switch needs, behind a small interface (:class:`ComputeApi`) with one HTTP implementation.

Shapes follow the compute API at microversion 2.79: services by uuid (2.53), flavors' extra specs embedded in
servers (2.47), aggregates with uuids (2.41).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from gpumode.cloud.openstack.http import ServiceClient, ServiceError

MICROVERSION = "2.79"

Action = Literal["stop", "start", "shelve", "unshelve", "live_migrate"]
_ACTION_BODIES: dict[str, dict[str, Any]] = {
    "stop": {"os-stop": None},
    "start": {"os-start": None},
    "shelve": {"shelve": None},
    "unshelve": {"unshelve": None},
    "live_migrate": {"os-migrateLive": {"host": None, "block_migration": "auto"}},
}


@dataclass(frozen=True, slots=True)
class ComputeService:
    id: str
    host: str
    enabled: bool
    disabled_reason: str | None


@dataclass(frozen=True, slots=True)
class Instance:
    id: str
    name: str
    status: str  # ACTIVE, SHUTOFF, SHELVED_OFFLOADED, MIGRATING, ERROR …
    host: str | None
    extra_specs: dict[str, str] = field(default_factory=dict)

    @property
    def uses_vgpu(self) -> bool:
        return "resources:VGPU" in self.extra_specs

    @property
    def uses_gpu(self) -> bool:
        """Asks for a vGPU or a passthrough device (resources:VGPU, pci_passthrough:alias, CUSTOM_PCI_*)."""
        return self.uses_vgpu or any(
            k == "pci_passthrough:alias" or k.startswith("resources:CUSTOM_PCI_") for k in self.extra_specs
        )


@dataclass(frozen=True, slots=True)
class Aggregate:
    id: int
    name: str
    uuid: str
    hosts: tuple[str, ...]


class ComputeApi(Protocol):
    def find_service(self, host: str) -> ComputeService | None: ...

    def set_service(self, service_id: str, *, enabled: bool, reason: str | None = None) -> ComputeService: ...

    def instances(self, host: str) -> list[Instance]: ...

    def instance(self, instance_id: str) -> Instance | None: ...

    def act(self, instance_id: str, action: Action) -> None: ...

    def aggregates(self) -> list[Aggregate]: ...

    def create_aggregate(self, name: str) -> Aggregate: ...

    def add_host(self, aggregate_id: int, host: str) -> Aggregate: ...

    def remove_host(self, aggregate_id: int, host: str) -> Aggregate: ...


class NovaCompute:
    """:class:`ComputeApi` over HTTP (``service_type = compute``)."""

    def __init__(self, client: ServiceClient) -> None:
        self.client = client

    def find_service(self, host: str) -> ComputeService | None:
        _, data = self.client.call("GET", f"/os-services?binary=nova-compute&host={host}")
        found = [_service(s) for s in data["services"] if s["host"] == host]
        return found[0] if found else None

    def set_service(self, service_id: str, *, enabled: bool, reason: str | None = None) -> ComputeService:
        body: dict[str, Any] = {"status": "enabled" if enabled else "disabled"}
        if not enabled and reason:
            body["disabled_reason"] = reason
        _, data = self.client.call("PUT", f"/os-services/{service_id}", body)
        return _service(data["service"])

    def instances(self, host: str) -> list[Instance]:
        _, data = self.client.call("GET", f"/servers/detail?host={host}&all_tenants=1")
        return [_instance(s) for s in data["servers"]]

    def instance(self, instance_id: str) -> Instance | None:
        try:
            _, data = self.client.call("GET", f"/servers/{instance_id}")
        except ServiceError as exc:
            if exc.status == 404:
                return None
            raise
        return _instance(data["server"])

    def act(self, instance_id: str, action: Action) -> None:
        self.client.call("POST", f"/servers/{instance_id}/action", _ACTION_BODIES[action], ok=(202,))

    def aggregates(self) -> list[Aggregate]:
        _, data = self.client.call("GET", "/os-aggregates")
        return [_aggregate(a) for a in data["aggregates"]]

    def create_aggregate(self, name: str) -> Aggregate:
        _, data = self.client.call("POST", "/os-aggregates", {"aggregate": {"name": name}})
        return _aggregate(data["aggregate"])

    def add_host(self, aggregate_id: int, host: str) -> Aggregate:
        _, data = self.client.call(
            "POST", f"/os-aggregates/{aggregate_id}/action", {"add_host": {"host": host}}, ok=(200,)
        )
        return _aggregate(data["aggregate"])

    def remove_host(self, aggregate_id: int, host: str) -> Aggregate:
        _, data = self.client.call(
            "POST", f"/os-aggregates/{aggregate_id}/action", {"remove_host": {"host": host}}, ok=(200,)
        )
        return _aggregate(data["aggregate"])


def _service(data: dict[str, Any]) -> ComputeService:
    return ComputeService(
        id=str(data["id"]),
        host=data["host"],
        enabled=data["status"] == "enabled",
        disabled_reason=data.get("disabled_reason"),
    )


def _instance(data: dict[str, Any]) -> Instance:
    flavor = data.get("flavor") or {}
    return Instance(
        id=data["id"],
        name=data.get("name", data["id"]),
        status=data["status"],
        host=data.get("OS-EXT-SRV-ATTR:host"),
        extra_specs={str(k): str(v) for k, v in (flavor.get("extra_specs") or {}).items()},
    )


def _aggregate(data: dict[str, Any]) -> Aggregate:
    return Aggregate(int(data["id"]), data["name"], data["uuid"], tuple(data.get("hosts") or ()))
