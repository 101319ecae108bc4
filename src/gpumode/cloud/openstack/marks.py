"""Mark each GPU's mode where the scheduler sees it: ``CUSTOM_GPUMODE_<MODE>`` traits, an aggregate per mode.

GPU providers carry their GPU's mode trait; the compute node's root provider carries the trait of every mode
its GPUs are in (accelerator and plain passthrough GPUs have no provider of their own). The root and GPU
providers are members of the per-mode aggregates. Changes are made provider by provider (each write is atomic
in Placement) and journaled; if one fails, those already made are put back, so a failed marking leaves
Placement as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from gpumode.cloud.openstack.expect import MODE_TRAITS, TRAIT_PREFIX, Expectation
from gpumode.cloud.openstack.http import OpenStackError, ServiceError
from gpumode.cloud.openstack.placement import PlacementClient, Provider
from gpumode.domain import Mode

GPUMODE_TRAITS = frozenset(MODE_TRAITS.values())


@dataclass(slots=True)
class MarkChange:
    kind: str  # "traits" | "aggregates"
    provider: Provider
    before: set[str]
    after: set[str]


@dataclass(slots=True)
class MarkResult:
    changes: list[MarkChange] = field(default_factory=list)

    def summary(self) -> str:
        if not self.changes:
            return "traits and aggregates already right"
        names = sorted({c.provider.name for c in self.changes})
        return f"traits/aggregates updated on {len(names)} provider(s): {', '.join(names)}"


def desired_traits(current: set[str], modes: set[Mode]) -> set[str]:
    """Keep every trait not ours; ours become exactly the given modes'."""
    return {t for t in current if not t.startswith(TRAIT_PREFIX)} | {MODE_TRAITS[m] for m in modes}


def desired_aggregates(current: set[str], modes: set[Mode], mode_aggregates: dict[Mode, str]) -> set[str]:
    ours = set(mode_aggregates.values())
    return {a for a in current if a not in ours} | {mode_aggregates[m] for m in modes if m in mode_aggregates}


def apply_marks(
    placement: PlacementClient,
    tree: list[Provider],
    expect: Expectation,
    mode_aggregates: dict[Mode, str],
) -> MarkResult:
    """Set traits and aggregates on every provider of the host's tree; all or nothing (see module doc)."""
    for trait in sorted(GPUMODE_TRAITS):
        placement.ensure_trait(trait)
    result = MarkResult()
    try:
        for provider in sorted(tree, key=lambda p: (p.parent_uuid is not None, p.name)):
            modes = provider_modes(provider, expect)
            try:
                _change(
                    result, "traits", provider, placement.update_traits, partial(desired_traits, modes=modes)
                )
                _change(
                    result,
                    "aggregates",
                    provider,
                    placement.update_aggregates,
                    partial(desired_aggregates, modes=modes, mode_aggregates=mode_aggregates),
                )
            except ServiceError as exc:
                # nova-compute removes the children its new configuration no longer names while gpumode
                # marks: a child gone meanwhile needs no marks
                if exc.status != 404 or provider.parent_uuid is None:
                    raise
    except Exception as exc:
        left = undo_marks(placement, result)
        extra = f"; could not put back: {left}" if left else "; changes made so far were put back"
        raise OpenStackError(f"marking GPU modes in Placement failed: {exc}{extra}") from exc
    return result


def provider_modes(provider: Provider, expect: Expectation) -> set[Mode]:
    """The modes a provider is marked with: root → all the host's modes; a GPU provider → its GPU's mode;
    a GPU provider no longer expected (stale after a switch) → none."""
    if provider.parent_uuid is None:
        return set(expect.root_modes)
    wanted = expect.provider(provider.name)
    return {wanted.mode} if wanted is not None else set()


def _change(
    result: MarkResult,
    kind: str,
    provider: Provider,
    update: Callable[[str, Callable[[set[str]], set[str]]], tuple[set[str], set[str]]],
    change: Callable[[set[str]], set[str]],
) -> None:
    before, after = update(provider.uuid, change)
    if before != after:
        result.changes.append(MarkChange(kind, provider, before, after))


def undo_marks(placement: PlacementClient, result: MarkResult) -> str:
    """Put back each journaled change, newest first; returns what could not be put back ('' when all was)."""
    failed: list[str] = []
    for change in reversed(result.changes):
        update = placement.update_traits if change.kind == "traits" else placement.update_aggregates
        try:
            update(change.provider.uuid, partial(_restore, change.before))
        except Exception as exc:
            failed.append(f"{change.kind} of {change.provider.name} ({exc})")
    return "; ".join(failed)


def _restore(before: set[str], _current: set[str]) -> set[str]:
    return set(before)
