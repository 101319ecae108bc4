"""The live server against its own OpenAPI document (#16): schemathesis generates requests for every
operation from the document, sends them over HTTP to a running server, authenticated as an admin, and checks
each answer against the document — no server error, only documented status codes, bodies and headers as
documented. A fixed seed and a bounded number of examples per operation keep it repeatable and short."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gpumode.cli.localserver import LocalServer

from .builders import host

EXAMPLES = 25


@schemathesis.check
def validators_no_stricter_than_the_document(ctx: Any, response: Any, case: Any) -> bool | None:
    """A request the document calls valid is never refused for a field the document describes (a 422
    naming a field): the validators and the document are the same rules. Not drift: a refusal for what the
    request means (a 422 with a message: "unknown node(s): …", a mode the whitelist forbids), and a rule
    across fields that JSON Schema cannot state (a 422 at the body itself: "gpus … not listed in
    functions")."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 422:
        return None
    detail = response.json().get("detail")
    fields = [e for e in detail if len(e.get("loc", ())) > 1] if isinstance(detail, list) else []
    if fields:
        raise AssertionError(f"schema-valid input refused by validation: {fields}"[:1000])
    return None


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    validators_no_stricter_than_the_document,
]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, str]]:
    server = LocalServer(Path(tmp_path_factory.mktemp("live")) / "gpumode.db")
    credentials = server.initialise(join_uses=5)
    server.start()
    try:
        import httpx

        snapshot = host("n1", 2).to_dict()
        r = httpx.post(
            f"{server.url}/api/v1/agents/join",
            headers={"Authorization": f"Bearer {credentials.join_token}"},
            json={"hostname": "n1", "snapshot": snapshot},
        )
        assert r.status_code == 201, r.text
        yield server, credentials.admin_token
    finally:
        server.stop()


@pytest.fixture(scope="module")
def live_schema(live: tuple[LocalServer, str]) -> Any:
    server, _ = live
    return schemathesis.openapi.from_url(f"{server.url}/api/v1/openapi.json")


def _fuzz(operation: Any, base_url: str, headers: dict[str, str], sent: list[int]) -> None:
    """Up to EXAMPLES generated requests to one operation, the same ones every run (derandomized)."""

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        sent.append(1)
        case.call_and_validate(base_url=base_url, headers=headers, checks=CHECKS)

    run()


@pytest.mark.slow  # ~750 requests over 38 operations: ~45-60 s
def test_every_operation_answers_as_documented(live_schema: Any, live: tuple[LocalServer, str]) -> None:
    server, admin = live
    operations = [result.ok() for result in live_schema.get_all_operations()]
    assert len(operations) >= 38
    failures: dict[str, str] = {}
    sent: list[int] = []
    for operation in operations:
        # its bearer is a join token: generated requests get the 401 it documents
        headers = {} if operation.path == "/agents/join" else {"Authorization": f"Bearer {admin}"}
        try:
            _fuzz(operation, server.url, headers, sent)
        except (AssertionError, BaseExceptionGroup) as exc:  # collected: one run reports every operation
            failures[operation.label] = str(exc)[:1500]
    print(f"{len(sent)} requests over {len(operations)} operations")
    assert len(sent) >= 10 * len(operations)
    assert failures == {}, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
