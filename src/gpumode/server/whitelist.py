"""Storage of the mode whitelist (method step 2): one row per level — the platform, a host group, a GPU model.

Only the data lives here; the rule that combines the levels for a GPU is the mode engine's
(``modes/policy.py``).
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from gpumode.domain import Mode
from gpumode.modes import policy
from gpumode.server.models import HostGroup, ModeRule
from gpumode.server.schemas import SWITCHABLE, Whitelist

PLATFORM, GROUP, MODEL = "platform", "group", "model"


class WhitelistError(ValueError):
    """The whitelist names something that does not exist."""


def load(session: Session) -> Whitelist:
    """The stored whitelist; a fresh database enables every mode platform-wide and narrows nothing."""
    platform = list(SWITCHABLE)
    groups: dict[str, list[Mode]] = {}
    models: dict[str, list[Mode]] = {}
    for rule in session.scalars(select(ModeRule).order_by(ModeRule.scope, ModeRule.key)):
        modes = [Mode(m) for m in rule.modes]
        if rule.scope == PLATFORM:
            platform = modes
        elif rule.scope == GROUP:
            groups[rule.key] = modes
        elif rule.scope == MODEL:
            models[rule.key] = modes
    return Whitelist.model_validate({"platform": platform, "groups": groups, "models": models})


def rules(session: Session) -> policy.Whitelist:
    """The stored whitelist in the engine's terms, read straight from its rows. Groups match by name only
    (the server knows their members); only NVIDIA models' rules apply (the planner switches only those)."""
    platform = frozenset(SWITCHABLE)
    groups: list[policy.HostGroup] = []
    models: dict[int, frozenset[Mode]] = {}
    for rule in session.scalars(select(ModeRule).order_by(ModeRule.scope, ModeRule.key)):
        modes = frozenset(Mode(m) for m in rule.modes)
        if rule.scope == PLATFORM:
            platform = modes
        elif rule.scope == GROUP:
            groups.append(policy.HostGroup(rule.key, (), modes))
        elif rule.scope == MODEL and rule.key.startswith("10de:"):
            models[int(rule.key.split(":")[1], 16)] = modes
    return policy.Whitelist(
        source="the server's whitelist (GET /api/v1/modes)",
        platform=platform,
        groups=tuple(groups),
        models=models,
    )


def store(session: Session, whitelist: Whitelist) -> None:
    """Replace the whole whitelist (flushes; the caller commits). Groups must exist."""
    known = set(session.scalars(select(HostGroup.name)))
    unknown = sorted(set(whitelist.groups) - known)
    if unknown:
        raise WhitelistError(
            f"unknown host group(s): {', '.join(unknown)} (create them with PUT /api/v1/groups/NAME)"
        )
    session.execute(delete(ModeRule))
    session.add(ModeRule(scope=PLATFORM, key="", modes=[m.value for m in whitelist.platform]))
    for name, modes in whitelist.groups.items():
        session.add(ModeRule(scope=GROUP, key=name, modes=[m.value for m in modes]))
    for key, modes in whitelist.models.items():
        session.add(ModeRule(scope=MODEL, key=key, modes=[m.value for m in modes]))
    session.flush()
