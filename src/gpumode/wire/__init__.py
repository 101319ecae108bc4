"""The wire protocol between gpumode processes: which documents cross (the server and its agents, the CLI and
the server), the schema id of each, the protocol version an agent speaks, and strict readers that refuse what
they do not know with a message naming it.

During an upgrade the server runs a newer gpumode than some agents. The rule: a server accepts agents of its
own protocol major and at most one minor older (``OLDEST_AGENT``); it sends each agent the documents of that
agent's version, and never a job whose host steps the agent cannot run.

Protocol history:

- ``1.0`` — gpumode 0.1.0. The agent sends no protocol header; the plan in a job has no ``schema`` key; its
  steps and impact carry exactly the fields of ``RELEASE_0_1_STEP_KEYS`` / ``RELEASE_0_1_IMPACT_KEYS``
  (0.1.0's parser passes each as keyword arguments, so one more field would break it).
- ``1.1`` — the agent says its protocol, version and host actions when it asks for work
  (``PROTOCOL_HEADER``, ``VERSION_HEADER``, ``ACTIONS_HEADER``); plans carry ``"schema": PLAN_SCHEMA``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpumode.domain import SNAPSHOT_SCHEMA


class WireError(ValueError):
    """A document or a protocol version this gpumode does not read; the message says what and why."""


@dataclass(frozen=True, order=True, slots=True)
class Protocol:
    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


def parse_protocol(text: str) -> Protocol:
    found = re.fullmatch(r"(\d{1,3})\.(\d{1,3})", text.strip())
    if found is None:
        raise WireError(f"protocol version {text!r} is not MAJOR.MINOR (e.g. 1.1)")
    return Protocol(int(found.group(1)), int(found.group(2)))


PROTOCOL = Protocol(1, 1)  # what this gpumode speaks
OLDEST_AGENT = Protocol(1, 0)  # the oldest agent a server of this gpumode accepts: one minor older
LEGACY = Protocol(1, 0)  # an agent that says nothing is gpumode 0.1.0

PROTOCOL_HEADER = "X-Gpumode-Protocol"
VERSION_HEADER = "X-Gpumode-Version"
ACTIONS_HEADER = "X-Gpumode-Actions"

# Every document that crosses a process, by kind: the schema ids this gpumode reads (the first one it writes).
PLAN_SCHEMA = "gpumode.plan/v1"
SCHEMAS: dict[str, tuple[str, ...]] = {
    "snapshot": (SNAPSHOT_SCHEMA,),  # agent -> server: the host (docs/snapshot-schema.md)
    "plan": (PLAN_SCHEMA,),  # server -> agent, in a job; CLI <- server, a dry run
}

# gpumode 0.1.0 (protocol 1.0): the host actions its agents run, and the fields its plan parser accepts.
RELEASE_0_1_ACTIONS = frozenset(
    {
        "vm.shutdown", "vm.detach_device", "vgpu.remove", "vgpu.create", "sriov.enable", "sriov.disable",
        "gpu.release", "bind.vfio", "bind.host", "service.start", "service.stop", "module.load",
        "module.unload", "driver.install", "driver.remove", "command.run", "file.write",
    }
)  # fmt: skip
RELEASE_0_1_STEP_KEYS = ("id", "action", "target", "params", "description", "where", "estimate_s")
RELEASE_0_1_IMPACT_KEYS = (
    "gpus", "vms_stopped", "devices_detached", "vgpus_reclaimed", "modules_unloaded", "modules_loaded",
    "packages_removed", "packages_installed", "driver_change", "reboot_required", "estimated_seconds",
)  # fmt: skip


def check_schema(kind: str, data: Mapping[str, Any], *, legacy: str | None = None) -> str:
    """The document's schema id, if this gpumode reads it; ``legacy`` is what a document without one is (a
    0.1.0 peer's). Anything else is refused, naming the kind, the id and what is read."""
    known = SCHEMAS[kind]
    schema = data.get("schema", legacy)
    if schema is None:
        raise WireError(f"the {kind} document has no schema; this gpumode reads {', '.join(known)}")
    if schema not in known:
        raise WireError(
            f"unsupported {kind} schema {schema!r}; this gpumode reads {', '.join(known)} "
            "(the sender runs a newer gpumode: upgrade this one)"
        )
    return str(schema)


# --- agents -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgentHello:
    """What an agent says about itself when it asks for work."""

    protocol: Protocol
    version: str | None  # the agent's gpumode version; None from 0.1.0
    actions: frozenset[str]  # the host actions it can run

    @property
    def out_of_date(self) -> bool:
        return self.protocol < PROTOCOL


def agent_hello(headers: Mapping[str, str]) -> AgentHello:
    """Read an agent's headers; an agent without them is 0.1.0. Refuses an agent this server cannot serve."""
    raw = headers.get(PROTOCOL_HEADER)
    if raw is None:
        return AgentHello(LEGACY, None, RELEASE_0_1_ACTIONS)
    protocol = parse_protocol(raw)
    if protocol.major != PROTOCOL.major or protocol < OLDEST_AGENT:
        raise WireError(
            f"agent protocol {protocol} is not served here: this server speaks {PROTOCOL} and accepts agents "
            f"from {OLDEST_AGENT}; install the server's gpumode version on the host"
        )
    version = headers.get(VERSION_HEADER)
    actions = frozenset(a for a in headers.get(ACTIONS_HEADER, "").split(",") if a)
    return AgentHello(protocol, version[:32] if version else None, actions)


def out_of_date(protocol: str | None) -> bool | None:
    """Whether an agent that said ``protocol`` speaks an older one than this gpumode (None: not heard yet)."""
    if protocol is None:
        return None
    return parse_protocol(protocol) < PROTOCOL


def hello_headers(protocol: Protocol, version: str, actions: Iterable[str]) -> dict[str, str]:
    """The headers an agent of ``protocol`` sends with each request for work (none for 1.0: 0.1.0 sent
    none)."""
    if protocol <= LEGACY:
        return {}
    names = ",".join(sorted(actions))
    return {PROTOCOL_HEADER: str(protocol), VERSION_HEADER: version, ACTIONS_HEADER: names}


def missing_actions(plan: Mapping[str, Any], agent: AgentHello) -> list[str]:
    """The plan's host actions the agent cannot run (cloud steps run on the server)."""
    wanted = {s["action"] for s in plan.get("steps", []) if s.get("where", "host") == "host"}
    return sorted(wanted - agent.actions)


# --- plans --------------------------------------------------------------------------------------------------


def plan_for(plan: Mapping[str, Any], protocol: Protocol) -> dict[str, Any]:
    """The stored plan as the agent of ``protocol`` reads it: 1.0 gets 0.1.0's fields only and no schema."""
    if protocol > LEGACY:
        return {**plan, "schema": PLAN_SCHEMA}
    old = {k: v for k, v in plan.items() if k != "schema"}
    old["steps"] = [{k: v for k, v in s.items() if k in RELEASE_0_1_STEP_KEYS} for s in plan.get("steps", [])]
    old["impact"] = {k: v for k, v in plan.get("impact", {}).items() if k in RELEASE_0_1_IMPACT_KEYS}
    return old


def read_plan(data: Mapping[str, Any]) -> dict[str, Any]:
    """A plan received from a server, checked: a known schema (none: a 0.1.0 server's, the same v1)."""
    check_schema("plan", data, legacy=PLAN_SCHEMA)
    return {k: v for k, v in data.items() if k != "schema"}
