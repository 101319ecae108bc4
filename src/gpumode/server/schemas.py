"""Request and response bodies of the REST API (the snapshot itself is in :mod:`gpumode.server.snapshot`)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
)

from gpumode.cloud.base import CardStatus
from gpumode.domain import Mode, VmPolicy
from gpumode.orm import as_utc
from gpumode.server.auth import USER_ROLES, Role
from gpumode.server.snapshot import Hostname, SnapshotIn

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"
_NAME = re.compile(NAME_PATTERN)
SWITCHABLE = (Mode.ACCEL, Mode.VGPU, Mode.PASSTHROUGH)


def _name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(f"not a valid name: {value!r} (letters, digits, '_', '.', ':', '-'; at most 64)")
    return value


Name = Annotated[str, AfterValidator(_name), WithJsonSchema({"type": "string", "pattern": NAME_PATTERN})]
# An id from a path, a query or a body, checked against its column before any query sees it: ids are INTEGER
# columns, 32-bit on PostgreSQL (64-bit on SQLite), so a larger number can name no row and would make the
# database driver fail instead of the query finding nothing.
MAX_ROW_ID = 2**31 - 1
RowId = Annotated[int, Field(ge=1, le=MAX_ROW_ID)]
# Seconds since the epoch in an agent's report: up to 2100-01-01, so a clock gone wild is refused (422)
# instead of overflowing a timestamp.
EpochSeconds = Annotated[float, Field(ge=0, le=4_102_444_800)]
# SQLite returns naive timestamps; they are UTC and leave the API marked so.
Utc = Annotated[datetime, AfterValidator(as_utc)]


class In(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- tokens
# -----------------------------------------------------------------------------------------------------


class TokenCreate(In):
    name: Name
    role: Annotated[Role, WithJsonSchema({"type": "string", "enum": [r.value for r in USER_ROLES]})]

    @field_validator("role")
    @classmethod
    def _user_role(cls, value: Role) -> Role:
        if value is Role.NODE:
            raise ValueError("node tokens are issued by joining (POST /api/v1/agents/join), not created here")
        return value


class TokenOut(BaseModel):
    id: int
    name: str
    role: str
    node: str | None
    revoked: bool
    created_at: Utc
    created_by: str | None


class TokenCreated(TokenOut):
    token: str = Field(description="the secret; shown once, store it now")


class JoinTokenCreate(In):
    name: Name
    uses: Annotated[int, Field(ge=1, le=100_000)] = Field(default=1, description="how many joins it allows")
    expires_in_s: Annotated[int, Field(ge=60, le=30 * 86400)] = Field(
        default=86400, description="seconds until it expires (every join token does)"
    )


class JoinTokenOut(BaseModel):
    id: int
    name: str
    uses: int | None = Field(description="joins it was made for (null: made by an older version)")
    uses_left: int | None
    expires_at: Utc | None
    revoked: bool
    created_at: Utc
    created_by: str | None


class JoinTokenCreated(JoinTokenOut):
    token: str
    join_command: str


# --- agents and nodes
# --------------------------------------------------------------------------------------------


class JoinRequest(In):
    hostname: Hostname
    snapshot: SnapshotIn
    node_token: Annotated[str, Field(min_length=1, max_length=128)] | None = Field(
        default=None,
        description="re-joining a node that exists: its current node token, as proof (or an admin first "
        "allows the replacement: POST /nodes/{name}/replace)",
    )


class JoinResponse(BaseModel):
    node: str
    token: str = Field(description="the node token; the agent stores it and uses it from now on")
    sync: dict[str, Any]


class ReplaceOut(BaseModel):
    node: str
    replace_until: Utc = Field(description="the next join under this name until then takes the node over")
    replace_by: str


class ReportResponse(BaseModel):
    node: str
    changed: bool
    fingerprint: str
    sync: dict[str, Any] | None = None


class GpuOut(BaseModel):
    address: str
    name: str
    device: str
    mode: str
    driver: str | None
    numa_node: int | None
    iommu_group: int | None
    companions: list[str]
    vfs: list[str]
    mdevs: list[str]
    vgpus: list[str]


class NodeOut(BaseModel):
    name: str
    group: str | None
    mode: str
    driver_state: str
    gpu_count: int
    fingerprint: str
    created_at: Utc
    changed_at: Utc
    last_seen: Utc | None = Field(default=None, description="last report seen by this server process")
    agent_version: str | None = Field(default=None, description="the agent's gpumode version (0.1.0: none)")
    agent_protocol: str | None = Field(default=None, description="the agent's wire protocol, e.g. 1.1")
    agent_out_of_date: bool | None = Field(
        default=None, description="the agent speaks an older protocol than the server: upgrade it"
    )


class NodeDetail(NodeOut):
    kernel: str | None
    nvidia: dict[str, Any]
    gpus: list[GpuOut]
    nvswitches: list[str]
    problems: list[str]
    cards: list[CardOut]


class GroupPut(In):
    nodes: Annotated[list[Hostname], Field(max_length=100_000)] = []


class GroupOut(BaseModel):
    name: str
    nodes: list[str]


# --- cards, profiles, aliases
# -------------------------------------------------------------------------------------


class CardOut(BaseModel):
    id: int
    node: str
    kind: str
    gpu: str
    device: str
    identity: str
    vgpu_type: str | None
    status: CardStatus
    holder: str | None
    created_at: Utc
    updated_at: Utc


class CardPatch(In):
    status: CardStatus | None = None
    holder: Annotated[str, Field(min_length=1, max_length=255)] | None = None


class ProfileIn(In):
    vgpu_type: Annotated[str, Field(min_length=1, max_length=128)]
    count_per_gpu: Annotated[int, Field(ge=1, le=64)]
    description: Annotated[str, Field(max_length=500)] = ""


class ProfileOut(ProfileIn):
    name: str


def _hex_id(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():  # JSON has one number type: 4318.0 is 4318
        number = int(value)
    elif isinstance(value, str):
        text = value.lower().removeprefix("0x")
        if not re.fullmatch(r"[0-9a-f]{1,4}", text):
            raise ValueError(f"not a PCI id: {value!r} (4 hex digits, e.g. '10de')")
        number = int(text, 16)
    else:
        raise ValueError(f"not a PCI id: {value!r}")
    if not 0 <= number <= 0xFFFF:
        raise ValueError(f"PCI id out of range: {value!r}")
    return number


HexId = Annotated[
    int,
    BeforeValidator(_hex_id),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": 0xFFFF},
                {"type": "string", "pattern": "^(0[xX])?[0-9a-fA-F]{1,4}$"},
            ]
        }
    ),
]


class AliasIn(In):
    vendor_id: HexId = Field(description="hex string ('10de') or integer")
    product_id: HexId
    description: Annotated[str, Field(max_length=500)] = ""


class AliasOut(BaseModel):
    name: str
    vendor_id: str
    product_id: str
    description: str


# --- whitelist, events, audit
# --------------------------------------------------------------------------------------

# A mode one can switch to: the enum's other members (none, mixed) only describe hosts.
SwitchMode = Annotated[Mode, WithJsonSchema({"type": "string", "enum": [m.value for m in SWITCHABLE]})]
ModeList = Annotated[list[SwitchMode], Field(max_length=3)]


def _switchable(modes: list[Mode]) -> list[Mode]:
    bad = [m.value for m in modes if m not in SWITCHABLE]
    if bad:
        raise ValueError(f"{', '.join(bad)}: not a mode one can switch to (use accel, vgpu, passthrough)")
    return sorted(set(modes), key=SWITCHABLE.index)


Modes = Annotated[ModeList, AfterValidator(_switchable)]


def _model_key(value: str) -> str:
    text = value.lower()
    if not re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{4}", text):
        raise ValueError(f"GPU model key {value!r} must be 'vendor:device' in hex, e.g. '10de:2330'")
    return text


ModelKey = Annotated[str, WithJsonSchema({"type": "string", "pattern": "^[0-9a-fA-F]{4}:[0-9a-fA-F]{4}$"})]


class Whitelist(In):
    """Enabled modes per level; a GPU may use a mode only if every level that names it allows the mode.

    ``platform`` is the reference list; ``groups`` narrows it per host group, ``models`` per GPU model
    (``vendor:device``). A level that is absent does not narrow.
    """

    platform: Modes = list(SWITCHABLE)
    # Keys are checked: the document says so (only keys of that form, nothing else).
    groups: dict[Name, Modes] = Field(default={}, json_schema_extra={"additionalProperties": False})
    models: dict[ModelKey, Modes] = Field(default={}, json_schema_extra={"additionalProperties": False})

    @field_validator("models")
    @classmethod
    def _model_keys(cls, value: dict[str, list[Mode]]) -> dict[str, list[Mode]]:
        return {_model_key(k): v for k, v in value.items()}


class EventOut(BaseModel):
    id: int
    node: str | None
    kind: str
    severity: str
    target: str | None
    message: str
    before: Any
    after: Any
    created_at: Utc


class AuditOut(BaseModel):
    id: int
    actor: str
    role: str | None
    action: str
    target: str | None
    status_code: int
    detail: str | None
    created_at: Utc


NodeDetail.model_rebuild()


# --- switch jobs, the agent's work, rollouts
# ----------------------------------------------------------------------


_MODES = [m.value for m in SWITCHABLE]
_VM_POLICIES = [p.value for p in VmPolicy]


class SwitchIn(In):
    """A switch request: a target mode for the node (or ``gpus``), its options, and the VM policy.

    Only the shape is checked here; what the fields mean is checked once, by
    :func:`gpumode.modes.policy.parse_request` (as for the local CLI and the dashboard), so a bad value gets
    the same error code on every path (docs/api.md)."""

    mode: Annotated[str, Field(max_length=32, json_schema_extra={"enum": _MODES})]
    gpus: Annotated[list[Annotated[str, Field(max_length=32)]], Field(max_length=512)] = []
    vgpu_type: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    vgpu_count: Annotated[int, Field(ge=1, le=64)] | None = None  # at most what the type allows: the policy
    profile: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    passthrough_alias: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    vm_policy: Annotated[str, Field(max_length=16, json_schema_extra={"enum": _VM_POLICIES})] = "gpu"
    allow_boot_vga: bool = False  # passthrough may take the boot display GPU (its console goes dark)


class RolloutIn(SwitchIn):
    concurrency: Annotated[int, Field(ge=1, le=1000)] = 1
    max_failures: Annotated[int, Field(ge=0, le=100_000)] = 0


class JobStepOut(BaseModel):
    id: str
    action: str
    target: str
    where: str
    description: str
    state: str
    started_at: str | None
    finished_at: str | None
    error: str | None
    note: str | None


class JobOut(BaseModel):
    id: int
    node: str
    state: str
    host_state: str
    request: dict[str, Any]
    plan: dict[str, Any]
    steps: list[JobStepOut]
    rollout: int | None
    cloud: dict[str, Any] | None = Field(
        description="What the cloud platform did around the job (null: nothing yet, or a platform without "
        "switch hooks): `waiting_since` while it waits for the platform, `taking` while it takes the node "
        "out of scheduling, then `hold` (e.g. the nova-compute service it disabled, the instances it "
        "stopped) with `released` and the `problems` it could not undo"
    )
    cancel_requested: bool
    error: str | None
    created_by: str | None
    created_at: Utc
    started_at: Utc | None
    finished_at: Utc | None
    updated_at: Utc


class DryRunOut(BaseModel):
    node: str
    dry_run: bool = True
    plan: dict[str, Any]


class WorkJob(BaseModel):
    id: int
    state: str
    cancel_requested: bool
    plan: dict[str, Any]


class WorkOut(BaseModel):
    job: WorkJob


class StepEventIn(In):
    step: Annotated[str, Field(min_length=1, max_length=200)]
    state: Literal["pending", "running", "done", "failed", "skipped", "undone"]
    at: EpochSeconds | None = Field(default=None, description="seconds since the epoch (before 2100)")
    error: Annotated[str, Field(max_length=8192)] | None = None
    note: Annotated[str, Field(max_length=2048)] | None = None


class HostResultIn(In):
    result: Literal["done", "rolled_back", "failed"]
    error: Annotated[str, Field(max_length=16384)] | None = None


class JobEventsIn(In):
    steps: Annotated[list[StepEventIn], Field(max_length=4096)] = []
    host: HostResultIn | None = None


class JobEventsAck(BaseModel):
    job: int
    state: str
    cancel_requested: bool
    retry_after_s: float | None = Field(
        default=None,
        description="The host steps are over and the job waits for the cloud platform: post again (even "
        '`{"steps": []}`) after this many seconds; each post is one more try. Absent otherwise.',
    )


class RolloutNodeOut(BaseModel):
    node: str
    job: int | None
    state: str
    error: str | None


class RolloutOut(BaseModel):
    id: int
    group: str
    state: str
    request: dict[str, Any]
    concurrency: int
    max_failures: int
    failures: int
    nodes: list[RolloutNodeOut]
    created_by: str | None
    created_at: Utc
    finished_at: Utc | None


class RolloutDryRunOut(BaseModel):
    group: str
    dry_run: bool = True
    plans: dict[str, dict[str, Any]]
