"""``POST /api/v1/nodes/{name}/report``: an agent's snapshot (method step 1), on the hot path of the fleet.

Every agent reports every few seconds and almost every report is unchanged, so this endpoint is built for
that case: **one** indexed read outside a transaction (the token, its node, and the reported node's stored
fingerprint and VM digest, joined), no write, and a response built without FastAPI's validation pass. On
SQLite that read runs on the event loop (a hop to a worker thread costs several times the read); on
PostgreSQL, a network round trip, it runs in a worker thread. An agent sends the same bytes for the same
report, so this process remembers, per node, the digest of the last body it validated and the fingerprint
and VM digest it found in it; a known body is not parsed again. What is remembered is only what the body
says, never what the database holds: the comparison is always with the database, so several server
processes stay right (one that saw body X, while another process stored other VMs since, still sees that the
VMs differ and stores X's again). Token revocation takes effect on the next report: nothing about tokens is
cached.
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy import bindparam, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import aliased
from starlette.concurrency import run_in_threadpool

from gpumode.domain import HostSnapshot
from gpumode.server import audit, card_holders, sync
from gpumode.server.auth import Role, bearer_secret, hash_secret, principal_of, token_lookup
from gpumode.server.deps import node_access
from gpumode.server.models import Node, vms_digest
from gpumode.server.responses import errors
from gpumode.server.schemas import ReportResponse
from gpumode.server.snapshot import SnapshotIn
from gpumode.server.state import ServerState

router = APIRouter(tags=["nodes"])

_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SnapshotIn"}}},
    }
}

_REPORTED = aliased(Node, name="reported")
# The token (as authenticate reads it) and the reported node's fingerprint and VM digest, in one round trip.
# Built once: building a statement costs more than running it on SQLite.
_LOOKUP = (
    token_lookup()
    .add_columns(_REPORTED.fingerprint, _REPORTED.vms_digest)
    .outerjoin(_REPORTED, _REPORTED.name == bindparam("node"))
)


@router.post(
    "/nodes/{name}/report",
    responses=errors(404, 409),
    response_model=ReportResponse,
    openapi_extra=_BODY,
    summary="Report the node's snapshot (node token of that node, or admin); unchanged → nothing is written",
)
async def report(name: str, request: Request) -> Response:
    state: ServerState = request.app.state.gpumode  # not a dependency: FastAPI's resolution costs per call
    body = await request.body()
    if state.inline_reader is not None:
        # SQLite: answer an unchanged report on the event loop; the hop to a worker thread would cost about
        # four times the read itself. Anything more (a parse, a write, a locked database) goes to a thread.
        try:
            answer = _report(name, body, request, state, inline=True)
        except OperationalError:
            answer = None
        if answer is not None:
            return answer
    answer = await run_in_threadpool(_report, name, body, request, state)
    assert answer is not None
    return answer


def _report(
    name: str, body: bytes, request: Request, state: ServerState, *, inline: bool = False
) -> Response | None:
    """Handle one report; ``inline``: only as far as answering an unchanged one from a known body (``None``
    when it is not that)."""
    started = time.perf_counter()
    secret = bearer_secret(request.headers.get("authorization"))
    if secret is None:
        raise _unauthorized()
    token_digest = hash_secret(secret)
    reader = state.inline_reader if inline and state.inline_reader is not None else state.reader
    with reader.connect() as conn:
        row = conn.execute(_LOOKUP, {"digest": token_digest, "node": name}).first()
    principal = principal_of(row, token_digest)
    if row is None or principal is None:
        raise _unauthorized()
    audit.set_principal(request, principal)
    node_access(principal, name, users_need=Role.ADMIN)

    digest = hashlib.sha256(body).hexdigest()
    known = state.known_bodies.get(name)
    snapshot, vms = None, None
    if known is not None and known[0] == digest:
        _, fingerprint, reported_vms = known
    elif inline:
        return None
    else:
        snapshot, vms = _parse(body, name)
        fingerprint, reported_vms = snapshot.fingerprint, vms_digest(vms)
    stored_fingerprint, stored_vms = row[6], row[7]
    if stored_fingerprint is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no node named {name!r}; agents join first")
    state.known_bodies[name] = (digest, fingerprint, reported_vms)  # what the body says, nothing stored
    if stored_fingerprint == fingerprint and reported_vms in (None, stored_vms):
        state.seen(name, datetime.now(UTC))
        audit.skip(request)
        state.metrics.observe_report("unchanged", time.perf_counter() - started)
        return _answer(ReportResponse(node=name, changed=False, fingerprint=fingerprint))
    if inline:
        return None

    now = datetime.now(UTC)
    state.seen(name, now)
    if snapshot is None:
        snapshot, vms = _parse(body, name)
    with state.sessions() as session:
        # Lock the row so two reports of one node (an agent restarting mid-report) apply one after the other.
        node = session.scalars(select(Node).where(Node.name == name).with_for_update()).one()
        platform = state.platform_factory(session)
        if vms is not None and node.vms_digest != reported_vms:
            node.vms = vms  # its digest with it (Node._digest_vms)
        if node.fingerprint == fingerprint:
            # the VMs changed, the hardware did not: planning input, and the cards follow the VMs
            held = card_holders.follow_vms(platform, name, node.vms, now)
            session.add_all(held)
            if held:
                audit.commit_audited(
                    request, session, target=f"node:{name}", detail=f"{len(held)} card(s) follow VMs"
                )
            else:
                session.commit()
                audit.skip(request)
            state.metrics.observe_report("unchanged", time.perf_counter() - started)
            return _answer(ReportResponse(node=name, changed=False, fingerprint=fingerprint))
        result = sync.apply_snapshot(session, platform, snapshot, now=now, node=node)[1]
        held = card_holders.follow_vms(platform, name, node.vms, now)  # new cards may be a VM's already
        session.add_all(held)
        audit.commit_audited(
            request,
            session,
            target=f"node:{name}",
            detail=f"snapshot {fingerprint}: {len(result.events)} event(s), cards +{result.cards_added} "
            f"-{result.cards_removed}, lost {result.cards_lost}",
        )
    state.metrics.observe_report("changed", time.perf_counter() - started)
    return _answer(ReportResponse(node=name, changed=True, fingerprint=fingerprint, sync=result.summary()))


def _answer(answer: ReportResponse) -> Response:
    """The JSON straight from the model: returning a Response skips FastAPI's second validation of it."""
    return Response(answer.model_dump_json(), media_type="application/json")


def _unauthorized() -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED,
        "missing or invalid bearer token",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _parse(body: bytes, name: str) -> tuple[HostSnapshot, list[dict[str, Any]] | None]:
    """Validate the body as a snapshot of ``name`` (and the VMs beside it); every problem is a 422 naming
    where it is."""
    try:
        parsed = SnapshotIn.model_validate_json(body)
        snapshot = parsed.to_domain()
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False)]
        ) from exc
    if snapshot.hostname != name:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"snapshot is for {snapshot.hostname!r}, reported to node {name!r}",
        )
    return snapshot, parsed.vms_json()
