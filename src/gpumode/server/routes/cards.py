"""Cards (derived from snapshots; status and holder set by the scheduler or an operator), vGPU profiles and
passthrough aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request, status

from gpumode.cloud.base import Card, CardError, CardStatus, PassthroughAlias, VgpuProfile
from gpumode.domain import Mode
from gpumode.server import audit, fleet_ops
from gpumode.server.deps import Operator, PlatformDep, SessionDep, Viewer
from gpumode.server.responses import errors
from gpumode.server.schemas import (
    NAME_PATTERN,
    AliasIn,
    AliasOut,
    CardOut,
    CardPatch,
    ProfileIn,
    ProfileOut,
    RowId,
)

router = APIRouter(tags=["cards"])
NamePath = Annotated[str, Path(pattern=NAME_PATTERN)]


@router.get("/cards", response_model=list[CardOut])
def list_cards(
    _: Viewer,
    platform: PlatformDep,
    node: str | None = None,
    status: CardStatus | None = None,
    kind: Mode | None = None,
) -> list[Card]:
    return platform.list_cards(node=node, status=status, kind=kind)


@router.patch(
    "/cards/{card_id}",
    responses=errors(404, 409),
    response_model=CardOut,
    summary="Set a card's status and holder (a lost card set free is released: removed)",
)
def patch_card(
    card_id: RowId, body: CardPatch, _: Operator, request: Request, session: SessionDep, platform: PlatformDep
) -> Card:
    card = platform.get_card(card_id)
    if card is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no card with id {card_id}")
    if body.status is CardStatus.LOST:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "only hardware sync marks a card lost")
    if card.status is CardStatus.LOST and body.status is not None:
        if body.status is not CardStatus.FREE:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"card {card_id} is lost (its device is gone); it can only be released (free)",
            )
        fleet_ops.release_lost(session, platform, card)
        audit.commit_audited(request, session, target=f"card:{card_id}", detail="lost card released")
        card.status, card.holder = CardStatus.FREE, None
        return card
    held = body.status in (CardStatus.IN_USE, CardStatus.RESERVED)
    if held and not (body.holder or card.holder):
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"status {body.status} needs a holder")
    updated = platform.update_card(
        card_id, status=body.status, holder=body.holder, clear_holder=body.status is CardStatus.FREE
    )
    audit.commit_audited(
        request,
        session,
        target=f"card:{card_id}",
        detail=f"status {updated.status.value}, holder {updated.holder or '-'}",
    )
    return updated


@router.get("/profiles", response_model=list[ProfileOut])
def list_profiles(_: Viewer, platform: PlatformDep) -> list[VgpuProfile]:
    return platform.list_profiles()


@router.put("/profiles/{name}", responses=errors(409), response_model=ProfileOut)
def put_profile(
    name: NamePath, body: ProfileIn, _: Operator, request: Request, session: SessionDep, platform: PlatformDep
) -> VgpuProfile:
    profile = platform.put_profile(VgpuProfile(name, body.vgpu_type, body.count_per_gpu, body.description))
    audit.commit_audited(
        request, session, target=f"profile:{name}", detail=f"{body.count_per_gpu} x {body.vgpu_type} per GPU"
    )
    return profile


@router.delete("/profiles/{name}", responses=errors(404, 409), status_code=status.HTTP_204_NO_CONTENT)
def delete_profile(
    name: str, _: Operator, request: Request, session: SessionDep, platform: PlatformDep
) -> None:
    try:
        platform.delete_profile(name)
    except CardError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
    audit.commit_audited(request, session, target=f"profile:{name}", status_code=204)


def _alias_out(alias: PassthroughAlias) -> AliasOut:
    return AliasOut(
        name=alias.name,
        vendor_id=f"{alias.vendor_id:04x}",
        product_id=f"{alias.product_id:04x}",
        description=alias.description,
    )


@router.get("/aliases", response_model=list[AliasOut])
def list_aliases(_: Viewer, platform: PlatformDep) -> list[AliasOut]:
    return [_alias_out(a) for a in platform.list_aliases()]


@router.put("/aliases/{name}", responses=errors(409), response_model=AliasOut)
def put_alias(
    name: NamePath, body: AliasIn, _: Operator, request: Request, session: SessionDep, platform: PlatformDep
) -> AliasOut:
    alias = platform.put_alias(PassthroughAlias(name, body.vendor_id, body.product_id, body.description))
    audit.commit_audited(
        request, session, target=f"alias:{name}", detail=f"{alias.vendor_id:04x}:{alias.product_id:04x}"
    )
    return _alias_out(alias)


@router.delete("/aliases/{name}", responses=errors(404, 409), status_code=status.HTTP_204_NO_CONTENT)
def delete_alias(
    name: str, _: Operator, request: Request, session: SessionDep, platform: PlatformDep
) -> None:
    try:
        platform.delete_alias(name)
    except CardError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
    audit.commit_audited(request, session, target=f"alias:{name}", status_code=204)
