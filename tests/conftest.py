"""Session-wide test fixtures: the emulated host templates every test directory copies from
(``tests/host_templates.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from host_templates import HostTemplates, session_templates


@pytest.fixture(scope="session", autouse=True)
def host_templates(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostTemplates]:
    """Autouse so that plain helpers (``make_host``) find the session's templates; it builds nothing until a
    test asks for a host."""
    with session_templates(tmp_path_factory) as templates:
        yield templates
