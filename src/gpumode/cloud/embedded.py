"""The default cloud platform: cards, vGPU profiles and passthrough aliases kept in gpumode's own database.

The tables live on :data:`gpumode.orm.metadata`, with the server's models, so one Alembic history covers them.
Cards name their node by hostname rather than by foreign key: a cloud platform knows hosts by name, and this
keeps the platform free of server imports (arrows point down).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Integer, String, delete, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from gpumode.cloud.base import (
    Card,
    CardCounts,
    CardError,
    CardSpec,
    CardStatus,
    CloudHostSteps,
    Drift,
    PassthroughAlias,
    VgpuProfile,
)
from gpumode.domain import HostSnapshot, Mode, Plan, VmPolicy
from gpumode.orm import NO_ID_REUSE, as_utc, metadata, utcnow


class CloudBase(DeclarativeBase):
    metadata = metadata


class CardRecord(CloudBase):
    __tablename__ = "cards"
    __table_args__ = NO_ID_REUSE

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(253), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    gpu: Mapped[str] = mapped_column(String(32))
    device: Mapped[str] = mapped_column(String(64))
    identity: Mapped[str] = mapped_column(String(96))
    vgpu_type: Mapped[str | None] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), index=True)
    holder: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    def to_card(self) -> Card:
        return Card(
            id=self.id,
            node=self.node,
            kind=Mode(self.kind),
            gpu=self.gpu,
            device=self.device,
            identity=self.identity,
            vgpu_type=self.vgpu_type,
            status=CardStatus(self.status),
            holder=self.holder,
            created_at=as_utc(self.created_at),
            updated_at=as_utc(self.updated_at),
        )


class VgpuProfileRecord(CloudBase):
    __tablename__ = "vgpu_profiles"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    vgpu_type: Mapped[str] = mapped_column(String(128))
    count_per_gpu: Mapped[int] = mapped_column(Integer)
    description: Mapped[str] = mapped_column(String(500), default="")


class PassthroughAliasRecord(CloudBase):
    __tablename__ = "passthrough_aliases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    vendor_id: Mapped[int] = mapped_column(Integer)
    product_id: Mapped[int] = mapped_column(Integer)
    description: Mapped[str] = mapped_column(String(500), default="")


class EmbeddedPlatform:
    """:class:`~gpumode.cloud.base.CloudPlatform` over a caller-owned SQLAlchemy session (flushes, never
    commits).
    """

    def __init__(self, session: Session) -> None:
        self.session = session

    # cards
    # -----------------------------------------------------------------------------------------------------

    def list_cards(
        self, *, node: str | None = None, status: CardStatus | None = None, kind: Mode | None = None
    ) -> list[Card]:
        query = select(CardRecord).order_by(CardRecord.node, CardRecord.gpu, CardRecord.device, CardRecord.id)
        if node is not None:
            query = query.where(CardRecord.node == node)
        if status is not None:
            query = query.where(CardRecord.status == status.value)
        if kind is not None:
            query = query.where(CardRecord.kind == kind.value)
        return [r.to_card() for r in self.session.scalars(query)]

    def get_card(self, card_id: int) -> Card | None:
        record = self.session.get(CardRecord, card_id)
        return None if record is None else record.to_card()

    def register_cards(self, specs: Sequence[CardSpec]) -> list[Card]:
        now = utcnow()
        records = [
            CardRecord(
                node=s.node,
                kind=s.kind.value,
                gpu=s.gpu,
                device=s.device,
                identity=s.identity,
                vgpu_type=s.vgpu_type,
                status=CardStatus.FREE.value,
                holder=None,
                created_at=now,
                updated_at=now,
            )
            for s in specs
        ]
        self.session.add_all(records)
        self.session.flush()
        return [r.to_card() for r in records]

    def remove_cards(self, card_ids: Sequence[int]) -> None:
        if card_ids:
            self.session.execute(delete(CardRecord).where(CardRecord.id.in_(list(card_ids))))

    def update_card(
        self,
        card_id: int,
        *,
        status: CardStatus | None = None,
        holder: str | None = None,
        clear_holder: bool = False,
    ) -> Card:
        record = self.session.get(CardRecord, card_id)
        if record is None:
            raise CardError(f"no card with id {card_id}")
        if status is not None:
            record.status = status.value
        if clear_holder:
            record.holder = None
        elif holder is not None:
            record.holder = holder
        record.updated_at = utcnow()
        self.session.flush()
        return record.to_card()

    def count_cards(self, nodes: Sequence[str] = ()) -> CardCounts:
        """Two ``GROUP BY`` queries: on the status index for the fleet, on the node index for ``nodes``."""
        by_status = select(CardRecord.status, func.count()).group_by(CardRecord.status)
        total = {CardStatus(status): n for status, n in self.session.execute(by_status)}
        by_node: dict[str, dict[CardStatus, int]] = {}
        if nodes:
            query = (
                select(CardRecord.node, CardRecord.status, func.count())
                .where(CardRecord.node.in_(list(nodes)))
                .group_by(CardRecord.node, CardRecord.status)
            )
            for node, status, n in self.session.execute(query):
                by_node.setdefault(node, {})[CardStatus(status)] = n
        return CardCounts(total, by_node)

    # profiles and aliases
    # ----------------------------------------------------------------------------------------

    def list_profiles(self) -> list[VgpuProfile]:
        rows = self.session.scalars(select(VgpuProfileRecord).order_by(VgpuProfileRecord.name))
        return [VgpuProfile(r.name, r.vgpu_type, r.count_per_gpu, r.description) for r in rows]

    def put_profile(self, profile: VgpuProfile) -> VgpuProfile:
        if profile.count_per_gpu < 1:
            raise CardError(f"profile {profile.name!r}: count_per_gpu must be at least 1")
        record = self.session.get(VgpuProfileRecord, profile.name) or VgpuProfileRecord(name=profile.name)
        record.vgpu_type = profile.vgpu_type
        record.count_per_gpu = profile.count_per_gpu
        record.description = profile.description
        self.session.add(record)
        self.session.flush()
        return profile

    def delete_profile(self, name: str) -> None:
        record = self.session.get(VgpuProfileRecord, name)
        if record is None:
            raise CardError(f"no vGPU profile named {name!r}")
        self.session.delete(record)
        self.session.flush()

    def list_aliases(self) -> list[PassthroughAlias]:
        rows = self.session.scalars(select(PassthroughAliasRecord).order_by(PassthroughAliasRecord.name))
        return [PassthroughAlias(r.name, r.vendor_id, r.product_id, r.description) for r in rows]

    def put_alias(self, alias: PassthroughAlias) -> PassthroughAlias:
        record = self.session.get(PassthroughAliasRecord, alias.name) or PassthroughAliasRecord(
            name=alias.name
        )
        record.vendor_id = alias.vendor_id
        record.product_id = alias.product_id
        record.description = alias.description
        self.session.add(record)
        self.session.flush()
        return alias

    def delete_alias(self, name: str) -> None:
        record = self.session.get(PassthroughAliasRecord, name)
        if record is None:
            raise CardError(f"no passthrough alias named {name!r}")
        self.session.delete(record)
        self.session.flush()

    # switch hooks: nothing outside gpumode's database schedules these cards, so there is nothing to do
    # ----------------------------------------------------------------------------------------------------

    @property
    def ready_timeout_s(self) -> float:
        return 0.0

    @property
    def retry_timeout_s(self) -> float:
        return 0.0

    @property
    def retry_interval_s(self) -> float:
        return 1.0

    def ready(self) -> str | None:
        return None

    def host_steps(self, plan: Plan, snapshot: HostSnapshot) -> CloudHostSteps:
        return CloudHostSteps()

    def before_switch(self, node: str, *, job: str, policy: VmPolicy) -> dict[str, Any]:
        return {}

    def after_switch(self, hold: dict[str, Any], *, succeeded: bool) -> list[str]:
        return []

    def set_up_cards(
        self, snapshot: HostSnapshot, *, alias: str | None = None, delivered: bool = False, wait: bool = True
    ) -> str:
        return ""

    def sync_hardware(self, snapshot: HostSnapshot) -> list[Drift]:
        return []
