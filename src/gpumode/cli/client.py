"""The remote CLI's side of the REST API: where the server is, who we are, and one call (on the HTTP layer
the agent uses too, :mod:`gpumode.apiclient`) that turns every failure into a :class:`RemoteError` carrying
the server's own message and the exit code for it.

Server URL, token and CA bundle come from, highest first: the ``--server``/``--token``/``--ca`` options, the
``GPUMODE_SERVER``/``GPUMODE_TOKEN``/``GPUMODE_CA`` environment, then the client config file
(``~/.config/gpumode/client.toml``, or the path given by ``--config`` / ``GPUMODE_CLIENT_CONFIG``). Each value
is resolved on its own, so a token from the environment can go with a server from the file.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpumode.apiclient import ApiError

DEFAULT_CONFIG = Path("~/.config/gpumode/client.toml")
CONFIG_ENV = "GPUMODE_CLIENT_CONFIG"
SERVER_ENV = "GPUMODE_SERVER"
TOKEN_ENV = "GPUMODE_TOKEN"
CA_ENV = "GPUMODE_CA"
CONFIG_KEYS = ("server", "token", "ca")

# Exit codes of the remote verbs (docs/cli.md): scripts tell "refused" from "unreachable" from "failed".
EXIT_FAILED = 1  # a job failed or was cancelled; the server answered 404 or 5xx
EXIT_BAD_INPUT = 2  # bad options, or the server refused the request as invalid (422)
EXIT_CONFLICT = 3  # the server refused because of the current state (409: busy node, job already ended)
EXIT_AUTH = 4  # 401 (no or bad token) / 403 (role too low)
EXIT_UNREACHABLE = 5  # no server configured, or it could not be reached


class RemoteError(Exception):
    """A call did not succeed; ``str()`` is the one line to show, ``exit_code`` what to exit with."""

    def __init__(self, message: str, exit_code: int, status: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.status = status


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Where the server is and the bearer token to use; ``source`` says where each came from (for errors)."""

    server: str
    token: str | None
    server_source: str
    token_source: str
    ca: Path | None = None  # verify the server against this CA bundle instead of the system store


def resolve_config(
    server: str | None = None,
    token: str | None = None,
    config_path: Path | None = None,
    environ: dict[str, str] | None = None,
    ca: Path | None = None,
) -> ClientConfig:
    """Resolve server and token by precedence: options > environment > config file.

    A config file named explicitly (option or environment) must exist; the default one is optional.
    """
    env = os.environ if environ is None else environ
    explicit = config_path or (Path(env[CONFIG_ENV]) if env.get(CONFIG_ENV) else None)
    path = (explicit or DEFAULT_CONFIG).expanduser()
    file_values = _read_config(path, required=explicit is not None)

    def pick(option: str | None, env_name: str, key: str) -> tuple[str | None, str]:
        if option:
            return option, f"--{key}"
        if env.get(env_name):
            return env[env_name], env_name
        if file_values.get(key):
            return file_values[key], str(path)
        return None, ""

    url, url_source = pick(server, SERVER_ENV, "server")
    secret, secret_source = pick(token, TOKEN_ENV, "token")
    ca_file, _ = pick(str(ca) if ca else None, CA_ENV, "ca")
    if url is None:
        raise RemoteError(
            f'no server given: pass --server URL, set {SERVER_ENV}, or put server = "URL" in {path}',
            EXIT_UNREACHABLE,
        )
    if not url.startswith(("http://", "https://")):
        raise RemoteError(
            f"server {url!r} (from {url_source}) is not an http:// or https:// URL", EXIT_BAD_INPUT
        )
    return ClientConfig(
        url.rstrip("/"), secret, url_source, secret_source, Path(ca_file).expanduser() if ca_file else None
    )


def _read_config(path: Path, *, required: bool) -> dict[str, str]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        if required:
            raise RemoteError(f"client config file {path} does not exist", EXIT_BAD_INPUT) from None
        return {}
    except OSError as exc:
        raise RemoteError(f"cannot read client config file {path}: {exc.strerror}", EXIT_BAD_INPUT) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RemoteError(f"client config file {path} is not valid TOML: {exc}", EXIT_BAD_INPUT) from exc
    unknown = sorted(set(data) - set(CONFIG_KEYS))
    if unknown:
        raise RemoteError(
            f"client config file {path}: unknown key(s) {', '.join(unknown)}; "
            f"known: {', '.join(CONFIG_KEYS)}",
            EXIT_BAD_INPUT,
        )
    bad = [k for k, v in data.items() if not isinstance(v, str)]
    if bad:
        raise RemoteError(f"client config file {path}: {', '.join(bad)} must be a string", EXIT_BAD_INPUT)
    return dict(data)


_STATUS_EXIT = {401: EXIT_AUTH, 403: EXIT_AUTH, 404: EXIT_FAILED, 409: EXIT_CONFLICT, 422: EXIT_BAD_INPUT}


class Client:
    """A thin, synchronous client of ``/api/v1`` on the shared HTTP layer (:mod:`gpumode.apiclient`): JSON
    in, JSON out, every failure a :class:`RemoteError` with the exit code for it."""

    def __init__(self, config: ClientConfig, *, timeout_s: float = 30.0) -> None:
        try:
            import httpx  # noqa: F401  (comes with the `server` extra)
        except ImportError as exc:
            raise RemoteError("the remote commands need httpx: pip install 'gpumode[server]'", 2) from exc
        from gpumode.apiclient import ApiClient
        from gpumode.tls import CaFileError, verify_context

        self.config = config
        try:
            verify = verify_context(config.ca)
        except CaFileError as exc:
            raise RemoteError(str(exc), EXIT_BAD_INPUT) from exc
        self._api = ApiClient(
            config.server,
            token=config.token,
            timeout_s=timeout_s,
            origin=f" (from {config.server_source})",
            verify=verify,
        )

    def close(self) -> None:
        self._api.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, json=body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        from gpumode.apiclient import ApiError

        try:
            response = self._api.send(method, path, **kwargs)
        except ApiError as exc:
            raise self._refusal(exc) from exc
        return response.json() if response.content else None

    def _refusal(self, exc: ApiError) -> RemoteError:
        if exc.status is None:
            return RemoteError(exc.message, EXIT_UNREACHABLE)
        message = f"{exc.status}: {exc.reply}"
        if exc.status == 401 and not self.config.token:
            message += f" (no token given: pass --token, set {TOKEN_ENV}, or put token in the config file)"
        return RemoteError(message, _STATUS_EXIT.get(exc.status, EXIT_FAILED), exc.status)
