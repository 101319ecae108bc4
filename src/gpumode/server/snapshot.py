"""The wire form of a host snapshot, validated strictly before anything is stored.

Mirrors :class:`gpumode.domain.HostSnapshot` field for field (unknown keys are refused), checks the schema
version, PCI address forms, id ranges and sizes, and that the fingerprint the agent sent is the fingerprint of
what it sent: the server skips unchanged snapshots by fingerprint alone, so a wrong one would hide a hardware
change.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from gpumode.domain import (
    SNAPSHOT_SCHEMA,
    DriverState,
    Flavour,
    HostSnapshot,
    Mode,
    fingerprint_of,
    normalize_address,
)

HOSTNAME_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?$"
_HOSTNAME = re.compile(r"^(?=.{1,253}$)" + HOSTNAME_PATTERN.removeprefix("^"))
_FINGERPRINT = re.compile(r"^sha256:[0-9a-f]{64}$")


# The kernel's form, as normalize_address writes it: most addresses match this at once (a body carries
# hundreds), only the others are parsed to say what is wrong with them.
_CANONICAL_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]")


def _canonical_address(value: str) -> str:
    """Addresses must come in the kernel's own form (``0000:3b:00.0``): one text, one fingerprint."""
    if _CANONICAL_ADDRESS.fullmatch(value):
        return value
    canonical = normalize_address(value)  # raises PciAddressError (a ValueError) on garbage
    if canonical != value:
        raise ValueError(f"PCI address {value!r} is not in canonical form (expected {canonical!r})")
    return value


def _whole(value: object) -> object:
    """JSON has one number type: ``5.0`` is the integer 5, as JSON Schema's ``integer`` (and so the OpenAPI
    document) says; ``5.5`` stays a float and is refused. Everything else stays strict."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def valid_hostname(value: str) -> str:
    if not _HOSTNAME.match(value):
        raise ValueError(f"not a valid hostname: {value!r} (letters, digits, '.', '-', '_'; at most 253)")
    return value


# The kernel's form: a 4-digit domain (more digits only for domains past 0xffff), lowercase hex.
ADDRESS_PATTERN = r"^(?:[0-9a-f]{4}|[1-9a-f][0-9a-f]{4,7}):[0-9a-f]{2}:[01][0-9a-f]\.[0-7]$"
Address = Annotated[
    str,
    Field(max_length=32),
    AfterValidator(_canonical_address),
    WithJsonSchema({"type": "string", "maxLength": 32, "pattern": ADDRESS_PATTERN}),
]
# The OpenAPI document shows the rule the validator applies, so generated clients (and fuzzers) send names
# the server takes.
Hostname = Annotated[
    str,
    AfterValidator(valid_hostname),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 253, "pattern": HOSTNAME_PATTERN}),
]
Text = Annotated[str, Field(max_length=512)]
U16 = Annotated[int, Field(ge=0, le=0xFFFF), BeforeValidator(_whole)]
Count = Annotated[int, Field(ge=0, le=1 << 20), BeforeValidator(_whole)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class MdevTypeIn(_Strict):
    type_id: Text
    name: Text
    description: Annotated[str, Field(max_length=4096)]
    available_instances: Count
    device_api: Text


class MdevIn(_Strict):
    uuid: Annotated[str, Field(pattern=r"^[0-9a-fA-F-]{36}$")]
    type_id: Text
    parent: Address


class VendorVgpuIn(_Strict):
    creatable: Annotated[
        dict[int, Text],
        Field(max_length=1024, json_schema_extra={"propertyNames": {"pattern": "^[0-9]{1,10}$"}}),
    ]
    current: Annotated[int, Field(ge=0, le=1 << 31), BeforeValidator(_whole)]

    # JSON object keys are strings; accept "1147" but nothing that is not a number.
    @field_validator("creatable", mode="before")
    @classmethod
    def _int_keys(cls, value: Any) -> Any:
        if isinstance(value, dict):
            try:
                return {int(k): v for k, v in value.items()}
            except (TypeError, ValueError) as exc:
                raise ValueError("creatable: keys must be vGPU type ids (integers)") from exc
        return value


class SriovIn(_Strict):
    total_vfs: Count
    num_vfs: Count
    vfs: Annotated[list[Address], Field(max_length=4096)] = []
    offset: U16 | None = None  # absent from older agents' snapshots
    stride: U16 | None = None


class PciFunctionIn(_Strict):
    address: Address
    vendor: U16
    device: U16
    subsystem_vendor: U16
    subsystem_device: U16
    class_code: Annotated[int, Field(ge=0, le=0xFFFFFF), BeforeValidator(_whole)]
    revision: Annotated[int, Field(ge=0, le=0xFF), BeforeValidator(_whole)]
    numa_node: Annotated[int, Field(ge=-1, le=4096), BeforeValidator(_whole)] | None = None
    iommu_group: Annotated[int, Field(ge=0, le=1 << 20), BeforeValidator(_whole)] | None = None
    driver: Text | None = None
    driver_override: Text | None = None
    vendor_name: Text | None = None
    device_name: Text | None = None
    class_name: Text | None = None
    physfn: Address | None = None
    sriov: SriovIn | None = None
    mdev_types: Annotated[list[MdevTypeIn], Field(max_length=1024)] = []
    mdevs: Annotated[list[MdevIn], Field(max_length=4096)] = []
    vendor_vgpu: VendorVgpuIn | None = None
    consumers: Annotated[list[Address], Field(max_length=64)] = []
    boot_vga: bool | None = None  # absent from older agents' snapshots


class GpuIn(_Strict):
    address: Address
    device: U16
    name: Text
    numa_node: Annotated[int, Field(ge=-1, le=4096), BeforeValidator(_whole)] | None
    iommu_group: Annotated[int, Field(ge=0, le=1 << 20), BeforeValidator(_whole)] | None
    driver: Text | None
    mode: Annotated[Mode, Field(strict=False)]
    companions: Annotated[list[Address], Field(max_length=256)] = []
    vfs: Annotated[list[Address], Field(max_length=4096)] = []
    mdevs: Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=4096)] = []
    vgpus: Annotated[list[Address], Field(max_length=4096)] = []


class LoadedModuleIn(_Strict):
    name: Text
    size: Annotated[int, Field(ge=0, le=1 << 40), BeforeValidator(_whole)]
    refcount: Annotated[int, Field(ge=-1, le=1 << 24), BeforeValidator(_whole)]
    users: Annotated[list[Text], Field(max_length=1024)]
    state: Text


class PackageIn(_Strict):
    name: Text
    version: Text
    flavour: Annotated[Flavour, Field(strict=False)] | None = None


class NvidiaDriverIn(_Strict):
    loaded: bool = False
    flavour: Annotated[Flavour, Field(strict=False)] | None = None
    version: Text | None = None
    open_kernel_module: bool | None = None
    vgpu_vfio_loaded: bool = False
    packages: Annotated[list[PackageIn], Field(max_length=256)] = []
    services: Annotated[dict[Text, bool], Field(max_length=256)] = {}


class VmDeviceIn(_Strict):
    kind: Literal["pci", "mdev"]
    id: Annotated[str, Field(min_length=1, max_length=64)]


class VmIn(_Strict):
    """A VM on the host (``gpumode.host.vms.Vm``): not part of the snapshot or its fingerprint, but the server
    needs it to plan a switch (which VMs to stop, which devices to detach)."""

    name: Annotated[str, Field(min_length=1, max_length=255)]
    uuid: Annotated[str, Field(max_length=64)]
    running: bool
    devices: Annotated[list[VmDeviceIn], Field(max_length=256)] = []


class SnapshotIn(_Strict):
    """A ``HostSnapshot`` as JSON (``HostSnapshot.to_dict()``), validated; ``vms`` optionally alongside."""

    hostname: Hostname
    kernel: Text | None
    functions: Annotated[list[PciFunctionIn], Field(max_length=8192)]
    gpus: Annotated[list[GpuIn], Field(max_length=512)]
    nvswitches: Annotated[list[Address], Field(max_length=64)] = []
    modules: Annotated[list[LoadedModuleIn], Field(max_length=4096)] = []
    nvidia: NvidiaDriverIn
    driver_state: Annotated[DriverState, Field(strict=False)]
    problems: Annotated[list[Annotated[str, Field(max_length=2048)]], Field(max_length=1024)] = []
    schema_: Annotated[
        str,
        Field(alias="schema", max_length=64),
        WithJsonSchema({"type": "string", "const": SNAPSHOT_SCHEMA}),
    ] = SNAPSHOT_SCHEMA
    fingerprint: Annotated[
        str, Field(max_length=80), WithJsonSchema({"type": "string", "pattern": "^(sha256:[0-9a-f]{64})?$"})
    ] = ""
    vms: Annotated[list[VmIn], Field(max_length=4096)] | None = None

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)
    _snapshot: HostSnapshot | None = PrivateAttr(default=None)
    _stored: dict[str, Any] = PrivateAttr()

    @field_validator("schema_")
    @classmethod
    def _known_schema(cls, value: str) -> str:
        if value != SNAPSHOT_SCHEMA:
            raise ValueError(f"unsupported snapshot schema {value!r}; this server reads {SNAPSHOT_SCHEMA!r}")
        return value

    @field_validator("fingerprint")
    @classmethod
    def _fingerprint_form(cls, value: str) -> str:
        if value and not _FINGERPRINT.match(value):
            raise ValueError("fingerprint must be 'sha256:' followed by 64 lowercase hex digits, or empty")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SnapshotIn:
        addresses = [fn.address for fn in self.functions]
        if len(set(addresses)) != len(addresses):
            raise ValueError("functions: a PCI address is listed more than once")
        gpu_addresses = [g.address for g in self.gpus]
        if len(set(gpu_addresses)) != len(gpu_addresses):
            raise ValueError("gpus: a GPU address is listed more than once")
        missing = sorted(set(gpu_addresses) - set(addresses))
        if missing:
            raise ValueError(f"gpus: {', '.join(missing)} not listed in functions")
        # Parsed once: the dump has the snapshot's ``to_dict()`` form (the models mirror the dataclasses field
        # for field, defaults filled in), so it is what is fingerprinted and stored, and the domain snapshot
        # is built from it when asked for (an unchanged report needs only the fingerprint).
        stored = self.model_dump(by_alias=True, mode="python", exclude={"vms"})
        computed = fingerprint_of(stored)
        if self.fingerprint and self.fingerprint != computed:
            raise ValueError(
                f"fingerprint {self.fingerprint} does not match the snapshot's content ({computed}); "
                "the agent must fingerprint exactly what it sends"
            )
        stored["fingerprint"] = computed
        self._stored = stored
        return self

    def vms_json(self) -> list[dict[str, Any]] | None:
        """The reported VMs as stored (``None``: the agent did not report them)."""
        return None if self.vms is None else [vm.model_dump() for vm in self.vms]

    @property
    def checked_fingerprint(self) -> str:
        """The snapshot's fingerprint: the agent's, checked, or computed when it sent none."""
        fingerprint: str = self._stored["fingerprint"]
        return fingerprint

    def to_domain(self) -> HostSnapshot:
        """The domain snapshot, its fingerprint checked (or filled in when the agent sent none)."""
        if self._snapshot is None:
            self._snapshot = HostSnapshot.from_dict(self._stored)
        return self._snapshot

    def stored_form(self) -> dict[str, Any]:
        """The snapshot as the server stores it: ``to_domain().to_dict()``, without building it again."""
        return self._stored
