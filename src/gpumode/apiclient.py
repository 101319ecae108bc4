"""The one HTTP layer under both clients of the server's ``/api/v1``: the remote CLI's
(:mod:`gpumode.cli.client`) and the agent's (:mod:`gpumode.agent.client`). One call, :meth:`ApiClient.send`,
and one error type, :class:`ApiError`: the server never answered (``status`` None), or it answered 4xx/5xx
with its ``detail``. What each client does with an error (the CLI exits with a code, the agent retries while
the server is away) stays with the client.

httpx is imported when a client is made, not with this module, so ``gpumode --help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl

from gpumode.errors import CODES, GpumodeError

if TYPE_CHECKING:
    import httpx

API = "/api/v1"


class ApiError(GpumodeError):
    """A call to the server did not succeed. ``status``: the HTTP status, None when the server never
    answered; ``detail``: the server's own ``detail``; ``code``: its error code when it gave one (a refused
    switch's ``unknown_mode``, say), else ``server_unreachable`` / ``server_refused``."""

    def __init__(
        self, message: str, *, status: int | None, detail: Any = None, what: str = "", reply: str = ""
    ) -> None:
        given = detail.get("code") if isinstance(detail, dict) else None
        if isinstance(given, str) and given in CODES:
            code = given
        else:
            code = "server_unreachable" if status is None else "server_refused"
        super().__init__(message, code=code)
        self.status = status
        self.detail = detail
        self.what = what  # "METHOD /path"
        self.reply = reply or message  # the server's detail as one line (:func:`server_message`)

    @property
    def away(self) -> bool:
        """The server is not there or cannot answer now (unreachable, 5xx): worth asking again later."""
        return self.status is None or self.status >= 500


class ApiClient:
    """Requests to one server's ``/api/v1``, with a bearer token (or one given per call)."""

    def __init__(
        self,
        server: str,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        origin: str = "",
        verify: ssl.SSLContext | bool = True,
        headers: dict[str, str] | None = None,
    ) -> None:
        import httpx

        self.server = server.rstrip("/")
        self.token = token
        self.origin = origin  # where the URL came from, for "cannot connect" (the CLI's --server, say)
        # verify: the context gpumode.tls builds (system store or the operator's CA); headers: sent with every
        # request (the agent's wire hello)
        self._http = httpx.Client(
            base_url=self.server + API, timeout=timeout_s, transport=transport, verify=verify, headers=headers
        )

    def close(self) -> None:
        self._http.close()

    def send(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        token: str | None = None,
    ) -> httpx.Response:
        """One request. Returns a 2xx response; raises :class:`ApiError` for anything else."""
        import httpx

        what = f"{method} {path}"
        headers: dict[str, str] = {}
        bearer = token or self.token
        if bearer:
            headers["Authorization"] = f"Bearer {bearer}"
        if content is not None:
            headers["Content-Type"] = "application/json"
        try:
            response = self._http.request(
                method,
                path,
                json=json,
                content=content,
                params=params,
                headers=headers,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.ConnectError as exc:
            raise ApiError(
                f"cannot connect to the gpumode server at {self.server}{self.origin}: {_reason(exc)}",
                status=None,
                what=what,
            ) from exc
        except httpx.TimeoutException as exc:
            raise ApiError(
                f"the gpumode server at {self.server} did not answer in time", status=None, what=what
            ) from exc
        except httpx.HTTPError as exc:
            raise ApiError(
                f"talking to the gpumode server at {self.server} failed: {exc}", status=None, what=what
            ) from exc
        if response.status_code >= 400:
            reply = server_message(response)
            raise ApiError(
                f"{what}: HTTP {response.status_code}: {reply}",
                status=response.status_code,
                detail=_detail(response),
                what=what,
                reply=reply,
            )
        return response


def _detail(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        return response.text
    return body.get("detail") if isinstance(body, dict) else body


def server_message(response: httpx.Response) -> str:
    """The server's ``detail`` as one line; a validation error lists each ``where: what``."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, str):
        return detail
    if isinstance(detail, dict):  # a refusal: {"code", "message", "choices"} or {"code", "message", "job"}
        message = str(detail.get("message") or detail.get("code") or detail)
        if detail.get("choices"):
            message += f" (choose from: {', '.join(str(c) for c in detail['choices'])})"
        if detail.get("job") is not None:
            message += f" (see: gpumode job {detail['job']})"
        return message
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict):
                loc = ".".join(str(p) for p in item.get("loc", []) if p != "body")
                parts.append(f"{loc}: {item.get('msg', '')}" if loc else str(item.get("msg", "")))
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return response.reason_phrase or "request failed"


def _reason(exc: Exception) -> str:
    text = str(exc)
    return "connection refused" if "refused" in text.lower() else text or type(exc).__name__
