"""Report bodies as real agents send them, for ``bench/sync.py``: made by the emulated fixtures, not by hand.

For each of the five fixture shapes an emulated host is created and looked at the way the agent looks
(:func:`gpumode.agent.report.look`, then :meth:`HostView.encoded`, byte for byte what it posts). Then, on a
fresh copy of that host each, one real change is made through the same host code a switch uses and the host
is looked at again:

- ``vm``: a running VM is shut down (the VM list changes, the hardware does not; back again: a VM started);
- ``vgpu``: a vGPU is created (an mdev on a parent that offers one, or a vendor vGPU type set on a free VF);
- ``switch``: a GPU that no VM holds is moved to ``vfio-pci`` (its whole IOMMU group);
- ``lost``: a GPU that no VM holds is hot-removed (``remove`` in sysfs), as a device falling off the bus.

A fixture only gets the changes it can make (an accel host has no vGPU to create). Per fleet host the bodies
are varied the way fleets vary: every PCI bus number shifted by a per-host amount (the same shift in every
address of the body, so the snapshot stays consistent), the VMs renamed for the host and some of them left
out, and, on hosts that can, the vGPU state as the base instead of the plain one. The fingerprint is
recomputed for each body, as the agent computes it.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gpumode
from gpumode.agent.report import look
from gpumode.domain import HostSnapshot, Mode
from gpumode.emulated.create import create_host
from gpumode.emulated.fixtures import FIXTURES
from gpumode.host import bind, vgpu
from gpumode.host.root import Host
from gpumode.host.vms import open_hypervisor

CHANGES = ("vm", "vgpu", "switch", "lost")
_ADDRESS = re.compile(r"\b([0-9a-f]{4}):([0-9a-f]{2}):([0-9a-f]{2}\.[0-7])\b")


@dataclass
class Shape:
    """One fixture's bodies: the plain state and each change it can make, as decoded JSON."""

    fixture: str
    base: dict[str, Any]
    changed: dict[str, dict[str, Any]]  # change name -> body after that one change
    max_bus: int


def _held(host: Host) -> set[str]:
    """PCI addresses and mdev uuids some VM of the host has in its definition."""
    return {d.id for vm in open_hypervisor(host).list_vms() for d in vm.devices}


def _shutdown_vm(host: Host) -> bool:
    hv = open_hypervisor(host)
    running = [vm for vm in hv.list_vms() if vm.running]
    if not running:
        return False
    hv.shutdown(running[0].name)
    return True


def _create_vgpu(host: Host) -> bool:
    snap = look(host).snapshot
    for fn in snap.functions:
        for t in fn.mdev_types:
            if t.available_instances > 0:
                vgpu.create_mdev(host, fn.address, t.type_id, persist=False)
                return True
    for fn in snap.functions:
        vv = fn.vendor_vgpu
        if vv is not None and vv.current == 0 and vv.creatable:
            vgpu.set_vgpu_type(host, fn.address, min(vv.creatable))
            return True
    return False


def _free_gpus(host: Host) -> list[str]:
    snap = look(host).snapshot
    held = _held(host)
    return [
        g.address
        for g in snap.gpus
        if g.address not in held and not g.mdevs and not g.vgpus and not set(g.vfs) & held
    ]


def _stop_gpu_services(host: Host) -> None:
    """What a switch away from accel does first: the daemons holding the GPUs (persistenced,
    fabricmanager) are stopped, so nvidia lets a GPU go."""
    for unit, active in look(host).snapshot.nvidia.services.items():
        if active:
            host.run(["systemctl", "stop", unit], check=True)


def _switch_gpu(host: Host) -> bool:
    _stop_gpu_services(host)
    snap = look(host).snapshot
    for address in _free_gpus(host):
        gpu = snap.gpu(address)
        if gpu is None or gpu.mode is Mode.PASSTHROUGH or gpu.vfs:
            continue
        try:
            bind.bind_to_vfio(host, address, persist=False)
        except bind.BindError:
            continue
        return True
    return False


def _lose_gpu(host: Host) -> bool:
    _stop_gpu_services(host)
    for address in _free_gpus(host):
        try:
            if bind.current_driver(host, address) == "nvidia":
                bind.release_from_nvidia(host, address)
            host.write(host.path("sys/bus/pci/devices", address, "remove"), "1")
        except (OSError, bind.BindError):
            continue
        return True
    return False


_MAKERS: dict[str, Callable[[Host], bool]] = {
    "vm": _shutdown_vm,
    "vgpu": _create_vgpu,
    "switch": _switch_gpu,
    "lost": _lose_gpu,
}


def _body(host: Host) -> dict[str, Any]:
    decoded: dict[str, Any] = json.loads(look(host).encoded())
    return decoded


def make_shape(fixture: str, workdir: Path) -> Shape:
    base_dir = workdir / fixture / "base"
    host = create_host(fixture, base_dir)
    base = _body(host)
    changed = {}
    for change, make in _MAKERS.items():
        copy = workdir / fixture / change
        shutil.copytree(base_dir, copy, symlinks=True)
        other = Host(copy)
        if make(other):
            body = _body(other)
            if body != base:
                changed[change] = body
        shutil.rmtree(copy)
    buses = [int(m.group(2), 16) for m in _ADDRESS.finditer(json.dumps(base))]
    shutil.rmtree(base_dir)
    return Shape(fixture, base, changed, max(buses, default=0))


def make_shapes(fixtures: list[str] | None = None) -> list[Shape]:
    with tempfile.TemporaryDirectory(prefix="gpumode-bench-bodies-") as tmp:
        return [make_shape(name, Path(tmp)) for name in (fixtures or sorted(FIXTURES))]


def _code_digest() -> str:
    """What the bodies depend on: the emulated host, discovery, the agent's encoding."""
    root = Path(gpumode.__file__).parent
    files = [Path(__file__), *sorted(root.glob("emulated/**/*.py"))]
    files += [*sorted(root.glob("host/*.py")), *sorted(root.glob("agent/*.py")), *sorted(root.glob("data/*"))]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cached_shapes(cache_dir: Path) -> list[Shape]:
    """:func:`make_shapes`, kept in ``cache_dir`` while the code that makes them is unchanged (making them
    takes a minute or more: five emulated hosts, twenty changes)."""
    path = cache_dir / f"bodies-{_code_digest()}.json"
    if path.is_file():
        return [Shape(**s) for s in json.loads(path.read_text())]
    shapes = make_shapes()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(s) for s in shapes]))
    tmp.replace(path)
    return shapes


def _shift(text: str, by: int) -> str:
    return _ADDRESS.sub(lambda m: f"{m.group(1)}:{int(m.group(2), 16) + by:02x}:{m.group(3)}", text)


def for_host(body: dict[str, Any], name: str, shift: int, keep_vms: int) -> bytes:
    """``body`` as host ``name`` would send it: buses shifted, VMs renamed (the first ``keep_vms`` kept),
    fingerprint recomputed; encoded as the agent encodes it."""
    data: dict[str, Any] = json.loads(_shift(json.dumps(body), shift))
    data["hostname"] = name
    if data.get("vms") is not None:
        data["vms"] = [
            {**vm, "name": f"{name}-{vm['name']}", "uuid": f"{vm['uuid'][:24]}{i:012d}"}
            for i, vm in enumerate(data["vms"][:keep_vms])
        ]
    vms = data.pop("vms", None)
    snap = HostSnapshot.from_dict(data)
    data["fingerprint"] = snap.compute_fingerprint()
    if vms is not None:
        data["vms"] = vms
    return json.dumps(data, separators=(",", ":")).encode()


@dataclass
class HostBodies:
    """One fleet host: what it reports normally, and what it reports after its change."""

    fixture: str
    change: str
    base: bytes
    changed: bytes


def fleet(names: list[str], shapes: list[Shape], seed: int = 7) -> dict[str, HostBodies]:
    """Bodies for every host: shapes in turn, each host with its own shift, VMs and change."""
    rng = random.Random(seed)
    out = {}
    for i, name in enumerate(names):
        shape = shapes[i % len(shapes)]
        changes = sorted(shape.changed)
        change = changes[(i // len(shapes)) % len(changes)]
        base = shape.base
        # On some hosts that can carry vGPUs, one already exists: the base is that state (and its change is
        # another one of the list, made from the plain state, so the body still differs).
        if "vgpu" in shape.changed and change != "vgpu" and rng.random() < 0.3:
            base = shape.changed["vgpu"]
        shift = rng.randrange(0, 0xFF - shape.max_bus + 1)
        vm_count = len(base.get("vms") or [])
        # the "vm" change stops the first running VM: keep them all there, so the change is in the body
        keep = vm_count if change == "vm" else rng.randrange(1, 1 + max(1, vm_count))
        out[name] = HostBodies(
            shape.fixture,
            change,
            for_host(base, name, shift, keep),
            for_host(shape.changed[change], name, shift, keep),
        )
    return out
