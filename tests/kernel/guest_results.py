"""Reading the guest's results (a module of its own: several test directories have a ``conftest``)."""

from __future__ import annotations

from typing import Any

import pytest


def passed(guest: dict[str, Any], name: str) -> dict[str, Any]:
    """The data of guest check ``name``; fails the test with the guest's error when that check failed."""
    entry = guest.get(name)
    if entry is None:
        pytest.fail(f"the guest did not run check {name!r} (guest log tail: {guest['_boot']['log']})")
    if not entry["ok"]:
        pytest.fail(f"guest check {name!r} failed: {entry['error']}\n{entry.get('traceback', '')}")
    data: dict[str, Any] = entry["data"]
    return data
