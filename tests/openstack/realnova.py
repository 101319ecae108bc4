"""REAL nova-compute for the tests marked ``nova``: each restart of nova-compute on an emulated host is one
run of ``novaside/compute.py`` in the nova venv (``scripts/install-openstack-test-deps.sh``), which starts
nova's libvirt driver over fakelibvirt mirrored from the host's snapshot and reports to the same real
Placement gpumode uses.

nova reads the configuration the host has at that moment (``/etc/nova/nova.conf`` and
``/etc/nova/nova.conf.d`` on the emulated host) and the devices it has at that moment, as nova-compute does
when systemd starts it."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumode.host.discover import discover
from gpumode.host.root import Host

from .services import HARNESS_HEADER

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "scripts" / "install-openstack-test-deps.sh"
COMPUTE = Path(__file__).resolve().parent / "novaside" / "compute.py"
NOVA_CONF = "/etc/nova/nova.conf"
NOVA_CONF_D = "/etc/nova/nova.conf.d"


def nova_python() -> str:
    """The nova venv's python: ``GPUMODE_NOVA_PYTHON``, else the install script's (installs once, then
    answers in a second). Fails, never skips: the ``nova`` tests are part of the check."""
    given = os.environ.get("GPUMODE_NOVA_PYTHON")
    if given:
        return given
    done = subprocess.run([str(INSTALL)], capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"{INSTALL.name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


class NovaComputeFailed(RuntimeError):
    """nova-compute did not start on this configuration and host (its traceback is the message)."""


@dataclass
class RealNovaCompute:
    """nova-compute of one emulated host; :meth:`restart` is ``systemctl restart nova-compute``."""

    python: str
    placement_url: str
    host: Host
    restarts: int = 0
    warnings: list[str] = field(default_factory=list)  # nova's WARNING/ERROR lines of the last start
    timeout_s: float = 180.0

    def restart(self) -> None:
        self.restarts += 1
        snapshot = discover(self.host)
        conf, conf_d = self.host.path(NOVA_CONF), self.host.path(NOVA_CONF_D)
        scenario = {
            "hostname": snapshot.hostname,
            "root": str(self.host.root),
            "placement_url": self.placement_url,
            "headers": {HARNESS_HEADER: "1"},  # nova-compute is spared by the tests' Placement faults
            "config_files": [str(conf)] if conf.exists() else [],
            "config_dirs": [str(conf_d)] if conf_d.is_dir() else [],
            "snapshot": snapshot.to_dict(),
        }
        with tempfile.TemporaryDirectory(prefix="nova-compute-") as tmp:
            scenario_path, result_path = Path(tmp, "scenario.json"), Path(tmp, "result.json")
            scenario_path.write_text(json.dumps(scenario))
            done = subprocess.run(
                [self.python, str(COMPUTE), str(scenario_path), str(result_path)],
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                cwd=tmp,
            )
            if not result_path.exists():
                why = done.stderr[-4000:]
                raise NovaComputeFailed(f"nova-compute runner exited {done.returncode}:\n{why}")
            result: dict[str, Any] = json.loads(result_path.read_text())
        self.warnings = list(result["warnings"])
        if not result["ok"]:
            raise NovaComputeFailed(result["error"])


PARSE = Path(__file__).resolve().parent / "novaside" / "parse.py"


def nova_parse(python: str, requests: list[dict[str, list[str]]]) -> list[dict[str, Any]]:
    """nova's own reading of each ``{config_files, config_dirs}`` (``novaside/parse.py``), in one process."""
    with tempfile.TemporaryDirectory(prefix="nova-parse-") as tmp:
        request_path, result_path = Path(tmp, "request.json"), Path(tmp, "result.json")
        request_path.write_text(json.dumps(requests))
        done = subprocess.run(
            [python, str(PARSE), str(request_path), str(result_path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp,
        )
        if not result_path.exists():
            raise NovaComputeFailed(f"nova's parse exited {done.returncode}:\n{done.stderr[-4000:]}")
        results: list[dict[str, Any]] = json.loads(result_path.read_text())
        return results
