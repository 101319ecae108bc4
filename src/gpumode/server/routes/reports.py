"""``POST /api/v1/nodes/{name}/report``: an agent's snapshot (method step 1), on the hot path of the fleet.

Every agent reports every few seconds and almost every report is unchanged, so this endpoint is built for
that case: **one** indexed read outside a transaction (the token, its node, and the reported node's stored
fingerprint, VM digest and report digest, joined), no write, and a response built without FastAPI's
validation pass. On SQLite that read runs on the event loop (a hop to a worker thread costs several times
the read); on PostgreSQL, a network round trip, it runs in a worker thread.

An agent sends the same bytes for the same report, so the node's row keeps the SHA-256 of the body its stored
snapshot and VMs were taken from (``nodes.report_digest``): a body with that digest is answered without being
parsed — by any server process, and right after a restart. A body with another digest is parsed once (the
validated model is fingerprinted, stored and diffed as it is, never rebuilt); if it says nothing new (new
bytes, same content: the first report after joining, an upgraded agent), its digest is stored with one
conditional UPDATE that only takes while the row still holds what the body says. Setting a node's snapshot or
VMs any other way clears the digest. Nothing about reports or tokens is kept in the process, so several
server processes share a fleet with nothing but the database between them (token revocation takes effect on
the next report).
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime

from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy import bindparam, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import aliased
from starlette.concurrency import run_in_threadpool

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
# The token (as authenticate reads it) and the reported node's fingerprint, VM digest and report digest, in
# one round trip.
# Built once: building a statement costs more than running it on SQLite.
_LOOKUP = (
    token_lookup()
    .add_columns(_REPORTED.fingerprint, _REPORTED.vms_digest, _REPORTED.report_digest)
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
    """Handle one report; ``inline``: only as far as answering an unchanged one from its digest (``None``
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

    stored_fingerprint, stored_vms, stored_report = row[6], row[7], row[8]
    if stored_fingerprint is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no node named {name!r}; agents join first")
    digest = hashlib.sha256(body).hexdigest()
    if digest == stored_report:  # the very body the stored state was taken from: nothing new in it
        return _unchanged(request, state, name, stored_fingerprint, started)
    if inline:
        return None
    parsed = _parse(body, name)
    vms = parsed.vms_json()
    fingerprint, reported_vms = parsed.checked_fingerprint, vms_digest(vms)
    if stored_fingerprint == fingerprint and reported_vms in (None, stored_vms):
        # Nothing new, in bytes not seen before (a first report after joining, an upgraded agent): remember
        # the body, but only while the database still holds what it says.
        _remember_body(state, name, digest, fingerprint, reported_vms)
        return _unchanged(request, state, name, fingerprint, started)

    now = datetime.now(UTC)
    state.seen(name, now)
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
            node.report_digest = digest
            if held:
                audit.commit_audited(
                    request, session, target=f"node:{name}", detail=f"{len(held)} card(s) follow VMs"
                )
            else:
                session.commit()
                audit.skip(request)
            state.metrics.observe_report("unchanged", time.perf_counter() - started)
            return _answer(ReportResponse(node=name, changed=False, fingerprint=fingerprint))
        snapshot, stored = parsed.to_domain(), parsed.stored_form()
        result = sync.apply_snapshot(session, platform, snapshot, now=now, node=node, stored=stored)[1]
        node.report_digest = digest  # after the snapshot and the VMs, which clear it
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


def _unchanged(request: Request, state: ServerState, name: str, fingerprint: str, started: float) -> Response:
    state.seen(name, datetime.now(UTC))
    audit.skip(request)
    state.metrics.observe_report("unchanged", time.perf_counter() - started)
    return _answer(ReportResponse(node=name, changed=False, fingerprint=fingerprint))


def _remember_body(
    state: ServerState, name: str, digest: str, fingerprint: str, reported_vms: str | None
) -> None:
    """Store ``digest`` as the node's report digest if its row still has ``fingerprint`` (and, when the body
    has VMs, their digest): one conditional UPDATE, once per new body; a node changed meanwhile by another
    report is left alone. A cache of what the database holds, so not audited."""
    conditions = [Node.name == name, Node.fingerprint == fingerprint]
    if reported_vms is not None:
        conditions.append(Node.vms_digest == reported_vms)
    with state.engine.begin() as conn:
        conn.execute(update(Node).where(*conditions).values(report_digest=digest))


def _answer(answer: ReportResponse) -> Response:
    """The JSON straight from the model: returning a Response skips FastAPI's second validation of it."""
    return Response(answer.model_dump_json(), media_type="application/json")


def _unauthorized() -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED,
        "missing or invalid bearer token",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _parse(body: bytes, name: str) -> SnapshotIn:
    """Validate the body as a snapshot of ``name`` (and the VMs beside it); every problem is a 422 naming
    where it is."""
    try:
        parsed = SnapshotIn.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False)]
        ) from exc
    if parsed.hostname != name:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"snapshot is for {parsed.hostname!r}, reported to node {name!r}",
        )
    return parsed
