"""A Placement API client: the calls gpumode needs, nothing more (providers, inventories, traits, aggregates,
allocations).

Writes that carry a provider generation retry on a concurrent update (nova-compute writes the same providers),
re-reading and re-applying the change, as every Placement client must.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpumode.cloud.openstack.http import ServiceClient, ServiceError

MICROVERSION = "1.39"  # aggregates with generations (1.19), in_tree (1.14), consumer types (1.38)
_RETRIES = 5


@dataclass(frozen=True, slots=True)
class Provider:
    uuid: str
    name: str
    generation: int
    parent_uuid: str | None
    root_uuid: str


class PlacementClient:
    """Placement over a :class:`ServiceClient` (``service_type = placement``)."""

    def __init__(self, client: ServiceClient) -> None:
        self.client = client

    # providers
    def provider_by_name(self, name: str) -> Provider | None:
        _, data = self.client.call("GET", f"/resource_providers?name={name}")
        found = [_provider(p) for p in data["resource_providers"]]
        return found[0] if found else None

    def tree(self, root_uuid: str) -> list[Provider]:
        _, data = self.client.call("GET", f"/resource_providers?in_tree={root_uuid}")
        return [_provider(p) for p in data["resource_providers"]]

    def delete_provider(self, uuid: str) -> None:
        """Delete a provider; refused here (and by Placement) while any consumer holds an allocation on it."""
        held = self.allocations(uuid)
        if held:
            raise ServiceError(
                "placement",
                "DELETE",
                f"/resource_providers/{uuid}",
                409,
                f"provider still has allocations from consumer(s) {', '.join(sorted(held))}",
            )
        self.client.call("DELETE", f"/resource_providers/{uuid}", ok=(204, 404))

    # inventories, allocations
    def inventories(self, uuid: str) -> dict[str, dict[str, Any]]:
        _, data = self.client.call("GET", f"/resource_providers/{uuid}/inventories")
        inventories: dict[str, dict[str, Any]] = data["inventories"]
        return inventories

    def allocations(self, uuid: str) -> dict[str, dict[str, int]]:
        """Consumer uuid → resources it holds on this provider."""
        _, data = self.client.call("GET", f"/resource_providers/{uuid}/allocations")
        return {c: dict(a["resources"]) for c, a in data["allocations"].items()}

    # traits
    def ensure_trait(self, name: str) -> None:
        self.client.call("PUT", f"/traits/{name}", ok=(201, 204))

    def traits(self, uuid: str) -> tuple[set[str], int]:
        _, data = self.client.call("GET", f"/resource_providers/{uuid}/traits")
        return set(data["traits"]), int(data["resource_provider_generation"])

    def update_traits(self, uuid: str, change: Callable[[set[str]], set[str]]) -> tuple[set[str], set[str]]:
        """Apply ``change`` to the provider's traits (read-modify-write); returns ``(before, after)``."""

        def attempt() -> tuple[set[str], set[str]]:
            before, generation = self.traits(uuid)
            after = change(set(before))
            if after != before:
                body = {"traits": sorted(after), "resource_provider_generation": generation}
                self.client.call("PUT", f"/resource_providers/{uuid}/traits", body)
            return before, after

        return _retry_on_conflict(attempt)

    # aggregates
    def aggregates(self, uuid: str) -> tuple[set[str], int]:
        _, data = self.client.call("GET", f"/resource_providers/{uuid}/aggregates")
        return set(data["aggregates"]), int(data["resource_provider_generation"])

    def update_aggregates(
        self, uuid: str, change: Callable[[set[str]], set[str]]
    ) -> tuple[set[str], set[str]]:
        def attempt() -> tuple[set[str], set[str]]:
            before, generation = self.aggregates(uuid)
            after = change(set(before))
            if after != before:
                body = {"aggregates": sorted(after), "resource_provider_generation": generation}
                self.client.call("PUT", f"/resource_providers/{uuid}/aggregates", body)
            return before, after

        return _retry_on_conflict(attempt)


def _provider(data: dict[str, Any]) -> Provider:
    return Provider(
        uuid=data["uuid"],
        name=data["name"],
        generation=int(data["generation"]),
        parent_uuid=data.get("parent_provider_uuid"),
        root_uuid=data.get("root_provider_uuid") or data["uuid"],
    )


def _retry_on_conflict(attempt: Callable[[], tuple[set[str], set[str]]]) -> tuple[set[str], set[str]]:
    """Run ``attempt`` again when another writer bumped the provider's generation in between (HTTP 409)."""
    for _ in range(_RETRIES - 1):
        try:
            return attempt()
        except ServiceError as exc:
            if exc.status != 409:
                raise
    return attempt()
