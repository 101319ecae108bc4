"""One way to call an OpenStack service: a keystoneauth1 adapter, JSON in and out, errors that say what
failed.

Every client (Placement, Nova, Cyborg) goes through :class:`ServiceClient`, so authentication, endpoint
lookup, microversions and error mapping live in one place.
"""

from __future__ import annotations

import re
from typing import Any

from keystoneauth1 import adapter, session
from keystoneauth1 import exceptions as ks_exc
from keystoneauth1.identity import v3
from keystoneauth1.plugin import BaseAuthPlugin
from keystoneauth1.token_endpoint import Token

from gpumode.cloud.base import CloudError
from gpumode.cloud.openstack.config import OpenStackConfig


class OpenStackError(CloudError):
    """An OpenStack operation failed or found the cloud not as expected; the message names what."""


class ServiceError(OpenStackError):
    """A service answered with an error status (``status``), or could not be reached (``status`` 0)."""

    def __init__(self, service: str, method: str, path: str, status: int, detail: str) -> None:
        where = f"{service} {method} {path}"
        what = f"unreachable ({detail})" if status == 0 else f"HTTP {status}: {detail}"
        super().__init__(f"{where}: {what}")
        self.service = service
        self.status = status
        self.detail = detail

    @property
    def unreachable(self) -> bool:
        return self.status == 0 or self.status >= 500


def make_session(config: OpenStackConfig) -> session.Session:
    """A keystoneauth1 session for the configured credentials (no network traffic until first use)."""
    auth: BaseAuthPlugin
    if config.auth_type == "noauth":
        auth = Token(None, config.noauth_token)
    elif config.auth_type == "application_credential":
        auth = v3.ApplicationCredential(
            auth_url=str(config.auth_url),
            application_credential_id=config.application_credential_id,
            application_credential_secret=str(config.application_credential_secret),
        )
    else:
        auth = v3.Password(
            auth_url=str(config.auth_url),
            username=config.username,
            password=str(config.password),
            project_name=config.project_name,
            user_domain_name=config.user_domain_name,
            project_domain_name=config.project_domain_name,
        )
    return session.Session(auth=auth, verify=config.verify_tls, timeout=config.timeout_s)


class ServiceClient:
    """JSON calls to one service at one microversion; error statuses raise :class:`ServiceError`."""

    def __init__(
        self,
        sess: session.Session,
        config: OpenStackConfig,
        *,
        service_type: str,
        name: str,
        microversion: str | None,
        endpoint: str | None,
    ) -> None:
        self.name = name
        self.adapter = adapter.Adapter(
            sess,
            service_type=service_type,
            interface=config.interface,
            region_name=config.region_name,
            endpoint_override=endpoint,
            default_microversion=microversion,
            raise_exc=False,
        )

    def call(
        self, method: str, path: str, body: Any = None, *, ok: tuple[int, ...] = (200, 201, 202, 204)
    ) -> tuple[int, Any]:
        """``(status, decoded JSON or None)``; a status outside ``ok`` raises :class:`ServiceError`."""
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs["json"] = body
        try:
            resp = self.adapter.request(path, method, **kwargs)
        except (ks_exc.ConnectionError, ks_exc.EndpointNotFound, ks_exc.ClientException) as exc:
            raise ServiceError(self.name, method, path, 0, _unreachable_cause(exc)) from exc
        data: Any = None
        if resp.content:
            try:
                data = resp.json()
            except ValueError:
                data = resp.text
        if resp.status_code not in ok:
            raise ServiceError(self.name, method, path, resp.status_code, _error_detail(data))
        return resp.status_code, data


def _unreachable_cause(exc: Exception) -> str:
    """The cause in a few words (``connection refused``, ``timed out``), not urllib3's whole chain."""
    if isinstance(exc, (ks_exc.ConnectTimeout, ks_exc.RequestTimeout)):
        return "timed out"
    text = str(exc) or type(exc).__name__
    errno = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if errno:
        return errno.group(1).strip().lower()
    return text.split(": HTTPConnectionPool")[0].split(": HTTPSConnectionPool")[0]


def _error_detail(data: Any) -> str:
    """The message of an OpenStack error body (Placement's ``errors[]``, Nova's ``{kind: {message}}``)."""
    if isinstance(data, dict):
        errors = data.get("errors")
        if isinstance(errors, list) and errors and isinstance(errors[0], dict):
            return "; ".join(str(e.get("detail") or e.get("title")) for e in errors)
        for value in data.values():
            if isinstance(value, dict) and "message" in value:
                return str(value["message"])
    return str(data)[:300] if data else "no body"
