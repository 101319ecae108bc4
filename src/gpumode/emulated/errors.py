"""Kernel-style failures and the kernel's input parsers.

Failures: an :class:`OSError` carrying the errno a real ``write(2)`` would return.

``OSError(errno, ...)`` picks the matching subclass (``PermissionError`` for EACCES/EPERM,
``FileNotFoundError`` for ENOENT), so callers catch exactly what they would on a real host. The message adds
what the kernel would have logged (dmesg), which a real errno alone never tells.
"""

from __future__ import annotations

import os


def kernel_error(code: int, detail: str, path: str | None = None) -> OSError:
    message = f"{os.strerror(code)} ({detail})" if detail else os.strerror(code)
    return OSError(code, message, path) if path is not None else OSError(code, message)


def kstrtoul(text: str, base: int = 0) -> int:
    """``kstrtoul``: one unsigned integer, optional ``0x``/leading-0 prefix with base 0, one trailing
    newline."""
    return _kstrto(text, base, signed=False)


def kstrtol(text: str, base: int = 0) -> int:
    """``kstrtol``: like :func:`kstrtoul` with an optional sign."""
    return _kstrto(text, base, signed=True)


def _kstrto(text: str, base: int, *, signed: bool) -> int:
    body = text[:-1] if text.endswith("\n") else text
    sign = 1
    if signed and body[:1] in ("-", "+"):
        sign, body = (-1 if body[0] == "-" else 1), body[1:]
    if base == 0:
        if body[:2].lower() == "0x":
            base, body = 16, body[2:]
        elif body.startswith("0") and len(body) > 1:
            base, body = 8, body[1:]
        else:
            base = 10
    if not body or body[0] in "+-_" or "_" in body or body.strip() != body:
        raise ValueError(f"not an integer: {text!r}")
    return sign * int(body, base)
