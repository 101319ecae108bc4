"""The whitelist, vGPU profiles and passthrough aliases: everyone may read them; admins edit the whitelist,
operators the profiles and aliases (the same roles as the API). Admins also allow a node's replacement."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import BaseModel, ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from gpumode.cloud.base import CardError, PassthroughAlias, VgpuProfile
from gpumode.server import audit, joining, whitelist
from gpumode.server.auth import Role
from gpumode.server.deps import SessionDep, StateDep
from gpumode.server.models import HostGroup
from gpumode.server.schemas import NAME_PATTERN, SWITCHABLE, AliasIn, ProfileIn, Whitelist
from gpumode.server.state import ServerState
from gpumode.server.web.access import WebUser, one, read_form, require_role
from gpumode.server.web.render import page
from gpumode.server.web.session import WebSession

router = APIRouter(include_in_schema=False)
UI = "/ui"
PAGE = f"{UI}/whitelist"
MODES = [m.value for m in SWITCHABLE]


def _render(
    request: Request,
    web: WebSession,
    session: Session,
    state: ServerState,
    *,
    error: str | None = None,
    status_code: int = 200,
) -> HTMLResponse:
    platform = state.platform_factory(session)
    return page(
        request,
        web,
        "whitelist.html",
        status_code,
        nav="whitelist",
        modes=MODES,
        error=error,
        wl=whitelist.load(session),
        groups=group_names(session),
        profiles=platform.list_profiles(),
        aliases=platform.list_aliases(),
    )


def group_names(session: Session) -> list[str]:
    return list(session.scalars(select(HostGroup.name).order_by(HostGroup.name)))


@router.get(PAGE, response_class=HTMLResponse)
def show(request: Request, web: WebUser, session: SessionDep, state: StateDep) -> HTMLResponse:
    return _render(request, web, session, state)


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'form'}: {e['msg']}" for e in exc.errors())


def whitelist_from_form(fields: dict[str, list[str]]) -> dict[str, Any]:
    """The form's checkboxes as the API's whitelist document.

    ``platform`` = the ticked ``platform`` boxes; a group is narrowed only when its ``narrow:<group>`` box is
    ticked (its modes: ``group:<name>``); models come as rows ``model_key[i]`` / ``model:<i>`` (a blank key
    drops the row).
    """
    doc: dict[str, Any] = {"platform": fields.get("platform", []), "groups": {}, "models": {}}
    for key in fields:
        if key.startswith("narrow:"):
            name = key.removeprefix("narrow:")
            doc["groups"][name] = fields.get(f"group:{name}", [])
    for index, model in enumerate(fields.get("model_key", [])):
        if model.strip():
            doc["models"][model.strip().lower()] = fields.get(f"model:{index}", [])
    return doc


@router.post(f"{PAGE}/modes", response_model=None)
async def save_whitelist(request: Request, web: WebUser, state: StateDep) -> Response:
    require_role(request, web, Role.ADMIN)
    doc = whitelist_from_form(await read_form(request, web))
    return await run_in_threadpool(_save_whitelist, request, web, state, doc)


def _save_whitelist(request: Request, web: WebSession, state: ServerState, doc: dict[str, Any]) -> Response:
    with state.sessions() as session:
        try:
            body = Whitelist.model_validate(doc)
            whitelist.store(session, body)
        except ValidationError as exc:
            session.rollback()
            return _render(request, web, session, state, error=_problems(exc), status_code=422)
        except whitelist.WhitelistError as exc:
            session.rollback()
            return _render(request, web, session, state, error=str(exc), status_code=422)
        audit.commit_audited(request, session, target="modes", detail=body.model_dump_json())
    return RedirectResponse(PAGE, status_code=status.HTTP_303_SEE_OTHER)


@router.post(f"{PAGE}/profiles", response_model=None)
async def save_profile(request: Request, web: WebUser, state: StateDep) -> Response:
    require_role(request, web, Role.OPERATOR)
    fields = await read_form(request, web)
    return await run_in_threadpool(_save_item, request, web, state, "profile", fields)


@router.post(f"{PAGE}/aliases", response_model=None)
async def save_alias(request: Request, web: WebUser, state: StateDep) -> Response:
    require_role(request, web, Role.OPERATOR)
    fields = await read_form(request, web)
    return await run_in_threadpool(_save_item, request, web, state, "alias", fields)


def _save_item(
    request: Request, web: WebSession, state: ServerState, kind: str, fields: dict[str, list[str]]
) -> Response:
    """Put or delete one profile or alias (``action`` = ``save`` | ``delete``)."""
    with state.sessions() as session:
        platform = state.platform_factory(session)
        name = one(fields, "name") or ""
        try:
            if not re.match(NAME_PATTERN, name):
                raise ValueError("a name is letters, digits, '_', '.', ':', '-' (at most 64)")
            if one(fields, "action") == "delete":
                (platform.delete_profile if kind == "profile" else platform.delete_alias)(name)
                detail = "deleted"
            elif kind == "profile":
                p: BaseModel = ProfileIn.model_validate(
                    {
                        "vgpu_type": one(fields, "vgpu_type") or "",
                        "count_per_gpu": one(fields, "count_per_gpu"),
                        "description": one(fields, "description") or "",
                    }
                )
                assert isinstance(p, ProfileIn)
                platform.put_profile(VgpuProfile(name, p.vgpu_type, p.count_per_gpu, p.description))
                detail = f"{p.count_per_gpu} x {p.vgpu_type} per GPU"
            else:
                a = AliasIn.model_validate(
                    {
                        "vendor_id": one(fields, "vendor_id") or "10de",
                        "product_id": one(fields, "product_id") or "",
                        "description": one(fields, "description") or "",
                    }
                )
                platform.put_alias(PassthroughAlias(name, a.vendor_id, a.product_id, a.description))
                detail = f"{a.vendor_id:04x}:{a.product_id:04x}"
        except ValidationError as exc:
            session.rollback()
            return _render(
                request, web, session, state, error=f"{kind} {name!r}: {_problems(exc)}", status_code=422
            )
        except (CardError, ValueError) as exc:
            session.rollback()
            return _render(request, web, session, state, error=f"{kind} {name!r}: {exc}", status_code=422)
        audit.commit_audited(request, session, target=f"{kind}:{name}", detail=detail)
    return RedirectResponse(PAGE, status_code=status.HTTP_303_SEE_OTHER)


@router.post(UI + "/nodes/{name}/replace", response_model=None)
async def allow_replacement(request: Request, name: str, web: WebUser, state: StateDep) -> Response:
    """The host page's "Allow replacement": ``POST /api/v1/nodes/{name}/replace`` for a signed-in admin."""
    require_role(request, web, Role.ADMIN)
    await read_form(request, web)
    await run_in_threadpool(_allow_replacement, request, web, state, name)
    return RedirectResponse(f"{UI}/nodes/{name}", status_code=status.HTTP_303_SEE_OTHER)


def _allow_replacement(request: Request, web: WebSession, state: ServerState, name: str) -> None:
    with state.sessions() as session:
        try:
            node = joining.allow_replacement(session, name, by=web.principal.name, now=datetime.now(UTC))
        except joining.UnknownNode as exc:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
        audit.commit_audited(
            request, session, target=f"node:{name}", detail=f"replacement allowed until {node.replace_until}"
        )
