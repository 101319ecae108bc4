"""The FastAPI application: ``/api/v1`` routes, ``/healthz``, ``/metrics``, OpenAPI at
``/api/v1/openapi.json``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import Engine
from starlette.concurrency import run_in_threadpool

from gpumode import __version__
from gpumode.server import conflicts, db, web
from gpumode.server.audit import AuditMiddleware
from gpumode.server.limits import BodyLimitMiddleware
from gpumode.server.metrics import Metrics
from gpumode.server.responses import AUTHENTICATED
from gpumode.server.routes import agents, cards, events, health, modes, nodes, reports, tokens, work
from gpumode.server.routes import jobs as job_routes
from gpumode.server.routes import sessions as session_routes
from gpumode.server.settings import Settings
from gpumode.server.state import ServerState, select_platform
from gpumode.server.switch import recovery, rollouts
from gpumode.server.switch.metrics import JobsCollector

API = "/api/v1"
log = logging.getLogger(__name__)


def create_app(settings: Settings, *, engine: Engine | None = None) -> FastAPI:
    """Build the app. It refuses to start on a database whose schema is not this gpumode's
    (``gpumode server migrate`` brings it there)."""
    engine = engine or db.make_engine(settings.db, pool_size=settings.db_pool_size)
    sessions = db.make_sessionmaker(engine)
    state = ServerState(
        settings=settings,
        engine=engine,
        sessions=sessions,
        metrics=Metrics(sessions),
        platform_factory=select_platform(settings),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(db.check_schema, engine)
        await run_in_threadpool(_recover_jobs, state)
        yield
        state.close()

    app = FastAPI(
        title="gpumode",
        version=__version__,
        summary="Move GPU hosts, and each GPU in them, between accel, vGPU and passthrough modes.",
        openapi_url=f"{API}/openapi.json",
        docs_url=f"{API}/docs",
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.gpumode = state
    state.metrics.registry.register(JobsCollector(sessions))
    for module in (agents, nodes, reports, cards, modes, events, tokens, session_routes, job_routes, work):
        app.include_router(module.router, prefix=API, responses=AUTHENTICATED)
    app.include_router(health.router)
    web.install(app)  # the dashboard under /ui (docs/dashboard.md)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
    conflicts.install(app)  # two servers racing on one database: 409 and a retry hint
    # Outermost first: refuse oversized bodies before anything else, then audit what remains.
    app.add_middleware(AuditMiddleware, sessions=lambda: state.sessions)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    return app


def _recover_jobs(state: ServerState) -> None:
    """Jobs and rollouts carry on after a restart: finish cloud steps left undone, move rollouts on."""
    with state.sessions() as session:
        platform = state.platform_factory(session)
        recovery.recover(session, platform)
        for rollout_id in rollouts.running_ids(session):
            rollouts.advance(session, rollout_id, platform)
        session.commit()


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    """422 with where and what, without echoing the (possibly large) input back."""
    assert isinstance(exc, RequestValidationError)
    errors: list[dict[str, Any]] = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in exc.errors()
    ]
    return JSONResponse({"detail": errors}, status_code=422)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"detail": "internal error; see the server log"}, status_code=500)
