"""VMs on a host, through one small interface.

The mode engine only needs to list VMs with their GPU devices, stop and start them, and take a device out of
(or put it back into) a VM's persistent definition. Two implementations: libvirt
(``gpumode.host.libvirt_vms``) and the emulated hypervisor of an emulated host
(``gpumode.emulated.hypervisor``). :func:`open_hypervisor` picks one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

# Vm and VmDevice live in gpumode.domain (the planner and the server use them); re-exported here for the
# host and emulated modules that import them with the Hypervisor protocol, this round.
from gpumode.domain import DeviceKind as DeviceKind
from gpumode.domain import Vm as Vm
from gpumode.domain import VmDevice as VmDevice
from gpumode.errors import GpumodeError

if TYPE_CHECKING:
    from gpumode.host.root import Host


class HypervisorError(GpumodeError, RuntimeError):
    """A VM operation failed; the message names the VM and what was attempted."""

    default_code = "hypervisor_failed"


class HypervisorUnavailable(HypervisorError):
    """No hypervisor to ask: its client library is not installed, or no hypervisor answers."""

    default_code = "no_hypervisor"


NO_HYPERVISOR_NOTE = "no hypervisor found: no VMs considered"


class Hypervisor(Protocol):
    def list_vms(self) -> list[Vm]:
        """All defined VMs (running or not) with their host devices."""
        ...

    def shutdown(self, name: str, *, timeout: float = 60.0) -> None:
        """Stop a VM: graceful shutdown, then destroy after ``timeout`` seconds. A stopped VM is a no-op."""
        ...

    def start(self, name: str) -> None:
        """Start a defined VM. A running VM is a no-op."""
        ...

    def detach_device(self, name: str, device: VmDevice) -> None:
        """Remove ``device`` from the VM's persistent definition. The VM must be stopped. Absent: no-op."""
        ...

    def attach_device(self, name: str, device: VmDevice) -> None:
        """Add ``device`` back to the VM's persistent definition (rollback). Present: no-op."""
        ...


class NoHypervisor:
    """Stands in when no hypervisor is found and the operator chose to go on without one: there are no VMs,
    and anything asked of a VM fails with the reason none was found."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"NoHypervisor({self.reason!r})"

    def list_vms(self) -> list[Vm]:
        return []

    def _refuse(self, name: str) -> HypervisorUnavailable:
        return HypervisorUnavailable(f"cannot act on VM {name}: {self.reason}")

    def shutdown(self, name: str, *, timeout: float = 60.0) -> None:
        raise self._refuse(name)

    def start(self, name: str) -> None:
        raise self._refuse(name)

    def detach_device(self, name: str, device: VmDevice) -> None:
        raise self._refuse(name)

    def attach_device(self, name: str, device: VmDevice) -> None:
        raise self._refuse(name)


def open_hypervisor(host: Host, uri: str | None = None) -> Hypervisor:
    """The hypervisor of ``host``: the emulated one on an emulated host, else libvirt at ``uri``."""
    if host.emulated:
        from gpumode.emulated.hypervisor import EmulatedHypervisor

        return EmulatedHypervisor(host)
    from gpumode.host.libvirt_vms import LibvirtHypervisor

    return LibvirtHypervisor(uri or "qemu:///system")
