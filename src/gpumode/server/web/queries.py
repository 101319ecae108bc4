"""What the dashboard's pages read, written so that no page loads the whole fleet.

The fleet page reads one page of nodes (``LIMIT``/``OFFSET`` on the indexed name) and asks the database
for every total (``COUNT`` … ``GROUP BY``); of the page's snapshots only the few fields the table shows
are read, extracted by the database. Events and the audit log page by id (keyset), newest first.

GPUs come from ``node_gpus`` (one row per GPU of each stored snapshot, kept by the sync): the model filter,
the model list and the GPUs per mode count every GPU, also one in mode ``none`` that offers no card. Cards
are counted by the cloud platform (:meth:`CloudPlatform.count_cards`), which knows where they are kept.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from gpumode import wire
from gpumode.cloud.base import Card, CardStatus, CloudPlatform
from gpumode.orm import as_utc
from gpumode.server import audit
from gpumode.server.models import AuditEntry, Event, HostGroup, Job, Node, NodeGpu

PAGE_SIZE = 50
STALE_AFTER = timedelta(minutes=2)  # agents report at least every few seconds; two minutes silent is stale
MODES = ("accel", "vgpu", "passthrough", "none", "mixed")


@dataclass(frozen=True, slots=True)
class FleetFilter:
    mode: str | None = None
    model: str | None = None  # "10de:2330"
    group: str | None = None
    page: int = 1


@dataclass(slots=True)
class FleetRow:
    name: str
    group: str | None
    mode: str
    driver_state: str
    gpu_count: int
    gpus: list[tuple[str, str]]  # (address, mode), by address
    models: str
    flavour: str | None
    version: str | None
    cards: dict[str, int]  # status -> count
    problems: list[str]
    last_report: datetime
    reported_live: bool  # seen by this server process (else last_report is when the snapshot changed)
    health: str  # ok | warning | stale | alarm


@dataclass(slots=True)
class FleetPage:
    rows: list[FleetRow]
    matching: int
    page: int
    pages: int
    hosts_by_mode: dict[str, int]
    gpus_by_mode: dict[str, int]  # every GPU, by its own mode (a host is "mixed", a GPU never is)
    cards_by_status: dict[str, int]
    groups: list[str]
    models: list[tuple[str, str]]  # (vendor:device, a name the hosts report for it)

    @property
    def gpus_total(self) -> int:
        return sum(self.gpus_by_mode.values())


def _conditions(f: FleetFilter) -> list[ColumnElement[bool]]:
    found: list[ColumnElement[bool]] = []
    if f.mode:
        found.append(Node.mode == f.mode)
    if f.group:
        found.append(HostGroup.name == f.group)
    if f.model:
        found.append(Node.id.in_(select(NodeGpu.node_id).where(NodeGpu.model == f.model)))
    return found


def fleet_page(
    session: Session,
    platform: CloudPlatform,
    f: FleetFilter,
    last_seen: dict[str, datetime],
    *,
    page_size: int = PAGE_SIZE,
) -> FleetPage:
    where = _conditions(f)
    joined = select(func.count(Node.id)).select_from(Node).outerjoin(HostGroup, HostGroup.id == Node.group_id)
    matching = session.scalar(joined.where(*where)) or 0
    pages = max(1, -(-matching // page_size))
    page = min(max(1, f.page), pages)
    # Ids first, through the name index; only then the page's rows. Reading whole rows while sorting would
    # drag every snapshot through (they are the bulk of the table).
    ids = list(
        session.scalars(
            select(Node.id)
            .outerjoin(HostGroup, HostGroup.id == Node.group_id)
            .where(*where)
            .order_by(Node.name)
            .limit(page_size)
            .offset((page - 1) * page_size)
        )
    )
    # Only the parts of each snapshot the table shows, extracted by the database: a vGPU host's snapshot
    # lists every VF and is many times larger than what the page needs.
    rows = session.execute(
        select(
            Node.id,
            Node.name,
            HostGroup.name.label("group"),
            Node.mode,
            Node.driver_state,
            Node.gpu_count,
            Node.changed_at,
            Node.snapshot[("nvidia", "flavour")].label("flavour"),
            Node.snapshot[("nvidia", "version")].label("version"),
            Node.snapshot["problems"].label("problems"),
        )
        .outerjoin(HostGroup, HostGroup.id == Node.group_id)
        .where(Node.id.in_(ids))
        .order_by(Node.name)
    ).all()
    gpus: dict[int, list[tuple[str, str, str]]] = defaultdict(list)
    if ids:
        for node_id, address, mode, name in session.execute(
            select(NodeGpu.node_id, NodeGpu.address, NodeGpu.mode, NodeGpu.name)
            .where(NodeGpu.node_id.in_(ids))
            .order_by(NodeGpu.node_id, NodeGpu.address)
        ):
            gpus[node_id].append((address, mode, name))
    counts = platform.count_cards([row.name for row in rows])
    by_mode = {m: 0 for m in MODES}
    by_mode.update(dict(session.execute(select(Node.mode, func.count()).group_by(Node.mode)).all()))
    gpus_by_mode = {m: 0 for m in MODES if m != "mixed"}
    gpus_by_mode.update(
        dict(session.execute(select(NodeGpu.mode, func.count()).group_by(NodeGpu.mode)).all())
    )
    by_status = {s.value: 0 for s in CardStatus}
    by_status.update({s.value: n for s, n in counts.total.items()})
    models = [
        (model, name)
        for model, name in session.execute(
            select(NodeGpu.model, func.min(NodeGpu.name)).group_by(NodeGpu.model).order_by(NodeGpu.model)
        )
    ]
    groups = list(session.scalars(select(HostGroup.name).order_by(HostGroup.name)))
    now = datetime.now(UTC)
    return FleetPage(
        rows=[
            _row(
                row,
                gpus.get(row.id, []),
                {s.value: n for s, n in counts.by_node.get(row.name, {}).items()},
                last_seen.get(row.name),
                now,
            )
            for row in rows
        ],
        matching=matching,
        page=page,
        pages=pages,
        hosts_by_mode=by_mode,
        gpus_by_mode=gpus_by_mode,
        cards_by_status=by_status,
        groups=groups,
        models=models,
    )


def _row(
    row: Any, gpus: list[tuple[str, str, str]], cards: dict[str, int], seen: datetime | None, now: datetime
) -> FleetRow:
    names: dict[str, int] = {}
    for _, _, name in gpus:
        names[name] = names.get(name, 0) + 1
    problems = [str(p) for p in row.problems or []]
    last = as_utc(seen) if seen is not None else as_utc(row.changed_at)
    if cards.get(CardStatus.LOST.value):
        health = "alarm"
    elif seen is not None and now - last > STALE_AFTER:
        health = "stale"
    elif problems:
        health = "warning"
    else:
        health = "ok"
    return FleetRow(
        name=row.name,
        group=row.group,
        mode=row.mode,
        driver_state=row.driver_state,
        gpu_count=row.gpu_count,
        gpus=[(address, mode) for address, mode, _ in gpus],
        models=", ".join(f"{n}× {name}" for name, n in sorted(names.items())) or "–",
        flavour=row.flavour,
        version=row.version,
        cards=cards,
        problems=problems,
        last_report=last,
        reported_live=seen is not None,
        health=health,
    )


# --- one host -----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class HostDetail:
    node: Node
    group: str | None
    cards_by_gpu: dict[str, list[Card]]
    vms: list[dict[str, Any]]
    events: list[Event]
    jobs: list[Job]
    active_job: int | None = None
    last_seen: datetime | None = None
    vm_of_device: dict[str, str] = field(default_factory=dict)

    @property
    def agent_out_of_date(self) -> bool:
        return bool(wire.out_of_date(self.node.agent_protocol))


def host_detail(
    session: Session, platform: CloudPlatform, name: str, last_seen: datetime | None
) -> HostDetail | None:
    row = session.execute(
        select(Node, HostGroup.name)
        .outerjoin(HostGroup, HostGroup.id == Node.group_id)
        .where(Node.name == name)
    ).first()
    if row is None:
        return None
    node, group = row
    by_gpu: dict[str, list[Card]] = defaultdict(list)
    for card in platform.list_cards(node=name):
        by_gpu[card.gpu].append(card)
    vms = list(node.vms or [])
    used_by = {d["id"]: vm["name"] for vm in vms for d in vm.get("devices", [])}
    events = list(
        session.scalars(select(Event).where(Event.node == name).order_by(Event.id.desc()).limit(20))
    )
    jobs = list(session.scalars(select(Job).where(Job.node == name).order_by(Job.id.desc()).limit(10)))
    active = next((j.id for j in jobs if j.state in ("queued", "running")), None)
    return HostDetail(node, group, dict(by_gpu), vms, events, jobs, active, last_seen, used_by)


# --- events and audit ---------------------------------------------------------------------------------------


def search_events(
    session: Session,
    *,
    q: str | None,
    node: str | None,
    kind: str | None,
    severity: str | None,
    before_id: int | None,
    limit: int = PAGE_SIZE,
) -> list[Event]:
    query = select(Event).order_by(Event.id.desc()).limit(limit)
    if q:
        query = query.where(_mentions(q, Event.message, Event.kind, Event.target, Event.node))
    if node:
        query = query.where(Event.node == node)
    if kind:
        query = query.where(Event.kind.startswith(kind, autoescape=True))
    if severity:
        query = query.where(Event.severity == severity)
    if before_id is not None:
        query = query.where(Event.id < before_id)
    return list(session.scalars(query))


def search_audit(
    session: Session,
    *,
    q: str | None,
    actor: str | None,
    before_id: int | None,
    people: bool = False,
    limit: int = PAGE_SIZE,
) -> list[AuditEntry]:
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if people:
        query = query.where(AuditEntry.role.in_(audit.PEOPLE))
    if q:
        query = query.where(
            _mentions(q, AuditEntry.action, AuditEntry.target, AuditEntry.detail, AuditEntry.actor)
        )
    if actor:
        query = query.where(AuditEntry.actor == actor)
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    return list(session.scalars(query))


def _mentions(text: str, *columns: InstrumentedAttribute[Any]) -> ColumnElement[bool]:
    """Any of ``columns`` contains ``text`` as typed (``%`` and ``_`` are not wildcards)."""
    return or_(*(column.contains(text, autoescape=True) for column in columns))
