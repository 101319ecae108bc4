"""Building the OpenStack platform from its configuration: clients over one keystoneauth1 session."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.orm import Session

from gpumode.cloud.openstack import compute, cyborg, placement
from gpumode.cloud.openstack.channel import NodeChannel
from gpumode.cloud.openstack.config import OpenStackConfig
from gpumode.cloud.openstack.http import ServiceClient, make_session
from gpumode.cloud.openstack.platform import OpenStackClients, OpenStackPlatform


def build_clients(config: OpenStackConfig, channel: NodeChannel | None = None) -> OpenStackClients:
    """Clients for every configured service over one keystoneauth1 session (nothing is contacted yet).

    Nova is driven when auth comes from Keystone or ``compute_endpoint`` is given; Cyborg when ``cyborg`` is
    on.
    """
    sess = make_session(config)

    def client(service_type: str, name: str, version: str, endpoint: str | None) -> ServiceClient:
        return ServiceClient(
            sess, config, service_type=service_type, name=name, microversion=version, endpoint=endpoint
        )

    nova = None
    if config.auth_type != "noauth" or config.compute_endpoint:
        nova = compute.NovaCompute(client("compute", "nova", compute.MICROVERSION, config.compute_endpoint))
    profiles = None
    if config.cyborg:
        profiles = cyborg.CyborgProfiles(
            client("accelerator", "cyborg", cyborg.MICROVERSION, config.cyborg_endpoint)
        )
    return OpenStackClients(
        placement=placement.PlacementClient(
            client("placement", "placement", placement.MICROVERSION, config.placement_endpoint)
        ),
        compute=nova,
        profiles=profiles,
        channel=channel,
    )


def platform_factory(
    config: OpenStackConfig, channel: NodeChannel | None = None
) -> Callable[[Session], OpenStackPlatform]:
    """A per-session platform factory sharing one set of clients (and so one token) across requests."""
    clients = build_clients(config, channel)

    def make(session: Session) -> OpenStackPlatform:
        return OpenStackPlatform(session, config, clients)

    return make
