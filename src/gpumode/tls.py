"""How gpumode's clients (the CLI, the agent) verify the server's certificate: against the operating system's
trust store, or against the one CA bundle an operator names (``--ca FILE``, for a private CA).

``ssl.create_default_context`` loads the system store (OpenSSL's default paths), where httpx on its own would
use certifi's bundle and ignore a CA the operator installed system-wide.
"""

from __future__ import annotations

import ssl
from pathlib import Path


class CaFileError(ValueError):
    """The CA bundle cannot be used; the message names the file."""


def verify_context(ca: Path | None = None) -> ssl.SSLContext:
    """A client context that verifies certificate and host name, trusting ``ca`` or else the system store."""
    if ca is None:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=str(ca))
    except FileNotFoundError:
        raise CaFileError(f"CA file {ca} does not exist") from None
    except (OSError, ssl.SSLError) as exc:
        raise CaFileError(f"CA file {ca} is not a PEM CA bundle ({exc})") from None
