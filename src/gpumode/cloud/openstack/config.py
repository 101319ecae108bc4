"""The ``[openstack]`` section of the server's configuration.

Kept in the cloud layer (the server's settings embed it) so the platform can be built and tested without a
server.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AuthType = Literal["password", "application_credential", "noauth"]
VmAction = Literal["stop", "shelve"]


class OpenStackConfig(BaseModel):
    """How gpumode reaches and drives an OpenStack cloud.

    Endpoints come from the Keystone catalog unless an ``*_endpoint`` override is given; with
    ``auth_type = "noauth"`` there is no catalog, so Placement's endpoint is required (Placement with
    ``[api] auth_strategy = noauth2`` accepts ``X-Auth-Token: admin``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    auth_type: AuthType = "password"
    auth_url: str | None = None
    username: str | None = None
    password: str | None = None
    project_name: str | None = None
    user_domain_name: str = "Default"
    project_domain_name: str = "Default"
    application_credential_id: str | None = None
    application_credential_secret: str | None = None
    noauth_token: str = "admin"
    region_name: str | None = None
    interface: str = "internal"
    verify_tls: bool = True
    timeout_s: float = Field(default=30.0, gt=0, description="one HTTP request")

    placement_endpoint: str | None = None
    compute_endpoint: str | None = None
    cyborg_endpoint: str | None = None
    cyborg: bool = Field(default=False, description="read vGPU layouts from Cyborg device profiles")

    nova_dropin: str = "/etc/nova/nova.conf.d/gpumode.conf"
    restart_command: list[str] = Field(default_factory=lambda: ["systemctl", "restart", "nova-compute"])
    pci_in_placement: bool = Field(default=False, description="nova's [pci] report_in_placement")
    inventory_timeout_s: float = Field(default=300.0, gt=0)
    placement_retry_s: float = Field(
        default=300.0,
        gt=0,
        description="after a job's host steps: how long its cloud steps keep trying while Placement is away "
        "(unreachable, 5xx, conflicts, the new inventory not shown yet) before the host is rolled back",
    )
    poll_interval_s: float = Field(default=2.0, gt=0)

    vm_action: VmAction = "stop"
    live_migrate_vgpu: bool = Field(default=False, description="live-migrate vGPU instances instead")
    vm_timeout_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _auth_complete(self) -> OpenStackConfig:
        missing: list[str] = []
        if self.auth_type == "password":
            needed = {
                "auth_url": self.auth_url,
                "username": self.username,
                "password": self.password,
                "project_name": self.project_name,
            }
            missing = [k for k, v in needed.items() if not v]
        elif self.auth_type == "application_credential":
            needed = {
                "auth_url": self.auth_url,
                "application_credential_id": self.application_credential_id,
                "application_credential_secret": self.application_credential_secret,
            }
            missing = [k for k, v in needed.items() if not v]
        elif not self.placement_endpoint:
            missing = ["placement_endpoint"]
        if missing:
            raise ValueError(f"auth_type {self.auth_type} needs {', '.join(missing)}")
        if not self.restart_command:
            raise ValueError("restart_command must name a command (e.g. systemctl restart nova-compute)")
        return self
