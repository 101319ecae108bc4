"""`gpumode discover`: JSON output, the person's view, bad --root, and the lazy imports that keep it fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_discover import datacenter_host, passthrough_host
from typer.testing import CliRunner

from gpumode.cli.main import app
from gpumode.domain import SNAPSHOT_SCHEMA, HostSnapshot
from gpumode.host.discover import discover

runner = CliRunner()


def test_json_is_the_snapshot(tmp_path: Path) -> None:
    datacenter_host(tmp_path)
    result = runner.invoke(app, ["discover", "--root", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schema"] == SNAPSHOT_SCHEMA
    assert HostSnapshot.from_dict(data) == discover(tmp_path)


def test_view_shows_header_gpus_switches_others_and_problems(tmp_path: Path) -> None:
    t = datacenter_host(tmp_path)
    (t.dirs["0000:3b:00.0"] / "numa_node").write_text("[red]x\n")  # a problem quoting Rich markup
    result = runner.invoke(app, ["discover", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for needle in (
        "hgx-1",
        "datacenter",
        "550.127.05",
        "nvidia-fabricmanager",
        "0000:18:00.0",
        "H100 SXM5 80GB",
        "accel",
        "NVSwitches (1): 0000:05:00.0",
        "Other functions (2)",
        "Ethernet controller",
        "numa_node: unreadable value '[red]x'",
    ):
        assert needle in out, f"{needle!r} missing from:\n{out}"


def test_view_of_passthrough_companions(tmp_path: Path) -> None:
    passthrough_host(tmp_path)
    result = runner.invoke(app, ["discover", "--root", str(tmp_path)])
    assert result.exit_code == 0
    assert "passthrough" in result.stdout and "0000:65:00.1, 0000:65:00.2" in result.stdout


def test_missing_root_is_exit_2_and_says_why(tmp_path: Path) -> None:
    result = runner.invoke(app, ["discover", "--root", str(tmp_path / "nope"), "--json"])
    assert result.exit_code == 2
    assert f"--root {tmp_path / 'nope'} does not exist" in result.stderr
    (tmp_path / "file").write_text("")
    result = runner.invoke(app, ["discover", "--root", str(tmp_path / "file")])
    assert result.exit_code == 2 and "is not a directory" in result.stderr


def test_json_path_does_not_import_rich_for_discovery(tmp_path: Path) -> None:
    """Rich is for people: the discovery modules and the --json path must not pull it in themselves."""
    datacenter_host(tmp_path)
    code = (
        "import sys; import gpumode.cli.discover as c, gpumode.host.discover as d; "
        f"d.discover({str(tmp_path)!r}).to_json(); "
        "print(sorted(m for m in sys.modules if m == 'rich' or m.startswith('rich.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
