"""The shipped systemd units (deploy/systemd/) pass ``systemd-analyze verify``, and every gpumode command they
run is one the CLI accepts."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpumode.cli.main import app as cli

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
NAMES = ("gpumode-server.service", "gpumode-agent.service", "gpumode-desired.service")
BINARY = "/opt/gpumode/bin/gpumode"  # where docs/deploy.md installs it


def _unit(name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNITS / name)
    return parser


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root for ``systemd-analyze --root``: this machine's own system units (multi-user.target, …), the
    gpumode units installed in etc/systemd/system, and a gpumode at the path they name, running this one."""
    system = Path("/usr/lib/systemd/system")
    if shutil.which("systemd-analyze") is None or not system.is_dir():
        pytest.fail("systemd-analyze is missing: run scripts/install-system-deps.sh", pytrace=False)
    shutil.copytree(system, tmp_path / "usr/lib/systemd/system", symlinks=True)
    (tmp_path / "lib").symlink_to("usr/lib")
    binary = tmp_path / BINARY.lstrip("/")
    binary.parent.mkdir(parents=True)
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} -m gpumode "$@"\n')
    binary.chmod(0o755)
    installed = tmp_path / "etc/systemd/system"  # where docs/deploy.md puts them
    installed.mkdir(parents=True)
    for name in NAMES:
        shutil.copy(UNITS / name, installed / name)
    return tmp_path


def test_units_pass_systemd_analyze_verify(root: Path) -> None:
    units = [str(root / "etc/systemd/system" / name) for name in NAMES]
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", f"--root={root}", *units],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_units_are_hardened_as_documented() -> None:
    server = _unit("gpumode-server.service")["Service"]
    assert server["User"] == "gpumode" and server["NoNewPrivileges"] == "yes"
    assert server["ProtectSystem"] == "strict" and server["CapabilityBoundingSet"] == ""
    desired = _unit("gpumode-desired.service")
    assert desired["Service"]["Type"] == "oneshot" and desired["Service"]["NoNewPrivileges"] == "yes"
    before = desired["Unit"]["Before"].split()
    assert {"libvirtd.service", "nova-compute.service", "gpumode-agent.service"} <= set(before)
    assert "gpumode-desired.service" in _unit("gpumode-agent.service")["Unit"]["After"].split()


@pytest.mark.parametrize("name", NAMES)
def test_unit_commands_are_gpumode_commands(name: str) -> None:
    service = _unit(name)["Service"]
    commands = [service[key] for key in ("ExecStartPre", "ExecStart") if key in service]
    assert commands
    for line in commands:
        binary, *args = shlex.split(line)
        assert binary == BINARY
        result = CliRunner().invoke(cli, [*args, "--help"])
        assert result.exit_code == 0, f"{line}: {result.output}"
