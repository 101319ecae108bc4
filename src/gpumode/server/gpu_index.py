"""The ``node_gpus`` table: each node's GPUs, one row each, taken from its stored snapshot.

The dashboard filters the fleet by GPU model and counts GPUs per mode; reading those from the snapshots would
decode every host's JSON, and reading them from the cards would miss a GPU that offers no card (mode
``none``, or cards a cloud keeps elsewhere). The sync rewrites a node's rows in the transaction that stores
its snapshot, so the table never disagrees with the snapshot it was made from. Migration 0005 back-fills it
for snapshots stored before it existed.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, insert
from sqlalchemy.orm import Session

from gpumode.domain import HostSnapshot, Mode
from gpumode.server.models import NodeGpu

NVIDIA = 0x10DE  # a snapshot's GPUs are NVIDIA's; only a malformed one lacks the function to read it from


def gpu_rows(snapshot: HostSnapshot | dict[str, Any]) -> list[dict[str, Any]]:
    """The snapshot's GPUs as ``node_gpus`` rows (without ``node_id``); the model is ``vendor:device``, the
    key the whitelist uses too. Read from the stored (JSON) form, which a domain snapshot is turned into."""
    data = snapshot if isinstance(snapshot, dict) else snapshot.to_dict()
    gpus = data["gpus"]
    addresses = {gpu["address"] for gpu in gpus}
    vendors = {fn["address"]: fn["vendor"] for fn in data["functions"] if fn["address"] in addresses}
    return [
        {
            "address": gpu["address"],
            "model": f"{vendors.get(gpu['address'], NVIDIA):04x}:{gpu['device']:04x}",
            "name": gpu["name"],
            "mode": str(Mode(gpu["mode"])),
            "driver": gpu["driver"],
        }
        for gpu in gpus
    ]


def store(session: Session, node_id: int, stored: dict[str, Any], old: dict[str, Any] | None) -> None:
    """Make the node's rows those of the snapshot ``stored`` (its stored form). Nothing is written when its
    GPUs read as in ``old`` (the snapshot stored until now): most changed reports change something else."""
    rows = gpu_rows(stored)
    if old is not None and gpu_rows(old) == rows:
        return
    session.execute(delete(NodeGpu).where(NodeGpu.node_id == node_id))
    if rows:
        session.execute(insert(NodeGpu), [{**row, "node_id": node_id} for row in rows])
