"""``POST /api/v1/nodes/{name}/report``: an agent's snapshot (method step 1), on the hot path of the fleet.

Every agent reports every few seconds and almost every report is unchanged, so this endpoint is built for
that case: one hop to a worker thread, two indexed reads (the token, the stored fingerprint), no write. An
agent sends the same bytes for the same snapshot, so a report whose body digest this process has already
validated skips parsing; its fingerprint is still compared with the database, so several server processes
stay correct.
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from gpumode.domain import HostSnapshot
from gpumode.server import audit, jobs, sync
from gpumode.server.auth import Role, authenticate, bearer_secret
from gpumode.server.deps import StateDep, node_access
from gpumode.server.models import Node
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


@router.post(
    "/nodes/{name}/report",
    response_model=ReportResponse,
    openapi_extra=_BODY,
    summary="Report the node's snapshot (node token of that node, or admin); unchanged → nothing is written",
)
async def report(name: str, request: Request, state: StateDep) -> ReportResponse:
    body = await request.body()
    return await run_in_threadpool(_report, name, body, request, state)


def _report(name: str, body: bytes, request: Request, state: ServerState) -> ReportResponse:
    started = time.perf_counter()
    with state.sessions() as session:
        secret = bearer_secret(request.headers.get("authorization"))
        principal = authenticate(session, secret) if secret else None
        if principal is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "missing or invalid bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        audit.set_principal(request, principal)
        node_access(principal, name, users_need=Role.ADMIN)

        digest = hashlib.sha256(body).hexdigest()
        known = state.known_bodies.get(name)
        fingerprint = known[1] if known and known[0] == digest else None
        snapshot = None
        vms: list[dict[str, Any]] | None = None
        if fingerprint is None:
            snapshot, vms = _parse(body, name)
            fingerprint = snapshot.fingerprint
        stored = sync.stored_fingerprint(session, name)
        if stored is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no node named {name!r}; agents join first")
        now = datetime.now(UTC)
        state.seen(name, now)
        if stored == fingerprint:
            if vms is not None and jobs.store_vms(session, name, vms):
                session.commit()  # the VMs changed, the hardware did not: planning input, not a sync
            state.known_bodies[name] = (digest, fingerprint)
            audit.skip(request)
            state.metrics.observe_report("unchanged", time.perf_counter() - started)
            return ReportResponse(node=name, changed=False, fingerprint=stored)

        if snapshot is None:
            snapshot, vms = _parse(body, name)
        # Lock the row so two reports of one node (an agent restarting mid-report) apply one after the other.
        node = session.scalars(select(Node).where(Node.name == name).with_for_update()).one()
        if vms is not None:
            node.vms = vms
        if node.fingerprint == fingerprint:
            session.commit()
            audit.skip(request)
            return ReportResponse(node=name, changed=False, fingerprint=fingerprint)
        result = sync.apply_snapshot(session, state.platform_factory(session), snapshot, now=now, node=node)[
            1
        ]
        audit.commit_audited(
            request,
            session,
            target=f"node:{name}",
            detail=f"snapshot {fingerprint}: {len(result.events)} event(s), cards +{result.cards_added} "
            f"-{result.cards_removed}, lost {result.cards_lost}",
        )
    state.known_bodies[name] = (digest, fingerprint)
    state.metrics.observe_report("changed", time.perf_counter() - started)
    return ReportResponse(node=name, changed=True, fingerprint=fingerprint, sync=result.summary())


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
