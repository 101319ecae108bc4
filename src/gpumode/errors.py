"""gpumode's own errors: one base class carrying a stable code and a message a person can act on, and the
one table of codes the local CLI, the REST API and the dashboard share (docs/api.md, docs/cli.md).

Each code has a :class:`Kind`; the CLI turns a kind into its exit code in one place
(:mod:`gpumode.cli.exits`) and the API into its HTTP status (:mod:`gpumode.server.routes.jobs`). Imports
nothing of gpumode's, like :mod:`gpumode.domain`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    BAD_INPUT = "bad_input"  # the request or a file is wrong; nothing was changed
    NOT_FOUND = "not_found"  # it names something that does not exist
    CONFLICT = "conflict"  # not now: the host or job is busy or in the wrong state
    FAILED = "failed"  # it was tried and did not work


@dataclass(frozen=True, slots=True)
class Code:
    kind: Kind
    meaning: str


CODES: dict[str, Code] = {
    # a switch request: the same code whichever door it came through (local CLI, REST API, dashboard)
    "missing_mode": Code(Kind.BAD_INPUT, "no target mode was given"),
    "unknown_mode": Code(Kind.BAD_INPUT, "the mode is not accel, vgpu or passthrough"),
    "unknown_vm_policy": Code(Kind.BAD_INPUT, "the VM policy is not all, gpu or refuse"),
    "bad_address": Code(Kind.BAD_INPUT, "a GPU address is not a PCI address (DDDD:BB:DD.F)"),
    "unknown_gpu": Code(Kind.BAD_INPUT, "the host has no such GPU (or no NVIDIA GPU at all)"),
    "invalid_option": Code(Kind.BAD_INPUT, "an option does not go with the mode or with another option"),
    "vgpu_type_required": Code(Kind.BAD_INPUT, "switching to vgpu needs a vGPU type"),
    "vgpu_type_not_offered": Code(Kind.BAD_INPUT, "the GPU does not offer that vGPU type"),
    "vgpu_count_exceeds": Code(Kind.BAD_INPUT, "more vGPUs than the type allows on the GPU"),
    "mode_not_allowed": Code(Kind.BAD_INPUT, "the whitelist or the hardware does not allow the mode"),
    "incompatible_modes": Code(Kind.BAD_INPUT, "accel and vgpu on one host (two builds of one driver)"),
    "vm_policy_refused": Code(Kind.BAD_INPUT, "VM policy 'refuse' and the switch would touch VMs"),
    "unknown_host_group": Code(Kind.BAD_INPUT, "the host group is not in the whitelist"),
    "host_state_unknown": Code(Kind.BAD_INPUT, "a GPU is in mode unknown: the nvidia build is not known"),
    "inconsistent_hardware": Code(Kind.BAD_INPUT, "a function the switch touches is gone or inconsistent"),
    "boot_vga": Code(Kind.BAD_INPUT, "passthrough of the boot display GPU needs allow_boot_vga"),
    "unknown_profile": Code(Kind.BAD_INPUT, "no vGPU profile of that name (server)"),
    "unknown_alias": Code(Kind.BAD_INPUT, "no passthrough alias of that name (server)"),
    "cloud_refused": Code(Kind.BAD_INPUT, "the cloud platform refused the plan's host steps (server)"),
    "not_plannable": Code(Kind.BAD_INPUT, "some members of the host group may not be switched (rollout)"),
    "empty_group": Code(Kind.BAD_INPUT, "the host group has no nodes (rollout)"),
    # the local CLI's own options and files
    "bad_options": Code(Kind.BAD_INPUT, "command-line options that do not go together"),
    "needs_confirmation": Code(Kind.BAD_INPUT, "not a terminal: pass --yes to apply without asking"),
    "bad_root": Code(Kind.BAD_INPUT, "--root does not name a host's root directory"),
    "bad_config": Code(Kind.BAD_INPUT, "a catalog or whitelist file is unreadable or invalid"),
    "bad_desired_state": Code(Kind.BAD_INPUT, "the host's desired-state file is unreadable or invalid"),
    # the server's
    "not_found": Code(Kind.NOT_FOUND, "no node, job, host group or rollout of that name or id"),
    "active_job": Code(Kind.CONFLICT, "the node already has a queued or running job"),
    "job_conflict": Code(Kind.CONFLICT, "the job or rollout is not in a state that allows this"),
    "unknown_step": Code(Kind.BAD_INPUT, "an agent reported a step the job does not have"),
    "cloud_step": Code(Kind.BAD_INPUT, "an agent reported a cloud step (the server runs those)"),
    "bad_result": Code(Kind.BAD_INPUT, "an agent reported a host result that is not an end"),
    # running on a host
    "engine_busy": Code(Kind.CONFLICT, "another gpumode runner holds the host"),
    "bad_journal": Code(Kind.CONFLICT, "a journal file is unreadable or not a gpumode journal"),
    "unsettled_run": Code(Kind.CONFLICT, "an unfinished run could not be settled, or the plan is stale"),
    "no_hypervisor": Code(Kind.BAD_INPUT, "no hypervisor to ask about VMs (library missing, none running)"),
    "hypervisor_failed": Code(Kind.FAILED, "a VM operation failed"),
}


class GpumodeError(Exception):
    """One of gpumode's own errors: ``code`` (a key of :data:`CODES`), ``message`` (what was wrong, said so
    a person can act on it) and ``choices`` (what would work, when that is a short list)."""

    default_code = "bad_options"

    def __init__(self, message: str, *, code: str | None = None, choices: Sequence[str] = ()) -> None:
        self.code = code or self.default_code  # in CODES: tests/test_error_codes.py checks every raise
        self.message = message
        self.choices = tuple(choices)
        super().__init__(message if not self.choices else f"{message} (valid: {', '.join(self.choices)})")

    @property
    def kind(self) -> Kind:
        known = CODES.get(self.code)
        return known.kind if known is not None else Kind.BAD_INPUT
