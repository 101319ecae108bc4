"""`plan`/`apply`/`status` on hosts that are not emulated: without libvirt-python, without a hypervisor
running, on `/`, and with a mistyped `--root` — one clear line each, or a plan that says what it left out."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpumode.cli.main import app
from gpumode.emulated.create import create_host
from gpumode.host.root import EMULATION_MARKER, Host
from host_templates import HostTemplates

runner = CliRunner()


def gpumode(*args: str) -> tuple[int, str, BaseException | None]:
    result = runner.invoke(app, list(args), env={"COLUMNS": "300"})
    exc = result.exception if not isinstance(result.exception, SystemExit) else None
    return result.exit_code, result.output, exc


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, host_templates: HostTemplates) -> Path:
    """A real-shaped tree that is not an emulated host (no emulation marker): gpumode treats it as real."""
    root = host_templates.copy(
        "a2-r580", lambda r: create_host("a2-r580", r), tmp_path_factory.mktemp("p") / "h"
    )
    shutil.rmtree(root / EMULATION_MARKER)
    assert not Host(root).emulated
    return root


@pytest.fixture
def no_libvirt(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(sys.modules, "libvirt", None)  # `import libvirt` now raises ImportError
    yield


def _one_line_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("error [") and "]: " in lines[0] and "Traceback" not in output
    return lines[0]


@pytest.mark.parametrize("verb", ["plan", "apply"])
def test_without_libvirt_python_one_line_names_the_extra(plain: Path, no_libvirt: None, verb: str) -> None:
    args = [verb, "--root", str(plain), "--mode", "passthrough"] + (["--yes"] if verb == "apply" else [])
    code, out, exc = gpumode(*args)
    assert exc is None and code == 2
    line = _one_line_error(out)
    assert "libvirt-python is not installed" in line and "gpumode[libvirt]" in line
    assert "--without-hypervisor" in line


def test_without_a_hypervisor_the_flag_gives_a_plan_that_says_so(plain: Path, no_libvirt: None) -> None:
    code, out, exc = gpumode("plan", "--root", str(plain), "--mode", "passthrough", "--without-hypervisor")
    assert exc is None and code == 0
    assert "no hypervisor found: no VMs considered" in out and "bind.vfio" in out
    code, out, _ = gpumode(
        "plan", "--root", str(plain), "--mode", "passthrough", "--without-hypervisor", "--json"
    )
    assert code == 0 and "no hypervisor found: no VMs considered" in out


def test_no_hypervisor_running_is_one_line(plain: Path) -> None:
    pytest.importorskip("libvirt")
    code, out, exc = gpumode("plan", "--root", str(plain), "--mode", "passthrough")
    if code == 0:
        pytest.skip("a libvirt daemon answers on this machine")
    assert exc is None and code == 2
    assert "no hypervisor running" in _one_line_error(out)


def test_status_needs_no_hypervisor(plain: Path, no_libvirt: None) -> None:
    code, out, exc = gpumode("status", "--root", str(plain))
    assert exc is None and code == 0 and "vgpu-host" in out


def test_plan_on_this_machine_without_libvirt(no_libvirt: None) -> None:
    code, out, exc = gpumode("plan", "--mode", "accel")
    assert exc is None and code == 2
    assert "libvirt-python is not installed" in _one_line_error(out)
    code, out, exc = gpumode("plan", "--mode", "accel", "--without-hypervisor")
    assert exc is None and code in (0, 2)
    if code == 2:  # a machine without NVIDIA GPUs (CI): that, in one line
        assert "no NVIDIA GPU" in _one_line_error(out)


@pytest.mark.parametrize("verb", ["plan", "apply", "status", "assert"])
def test_a_mistyped_root_is_one_line_naming_it(tmp_path: Path, verb: str) -> None:
    missing = tmp_path / "hots"
    args = [verb, "--root", str(missing)] + (["--mode", "accel"] if verb != "status" else [])
    code, out, exc = gpumode(*args)
    assert exc is None and code == 2
    assert _one_line_error(out) == f"error [bad_root]: --root {missing} does not exist"
    (tmp_path / "empty").mkdir()
    code, out, _ = gpumode(*[a if a != str(missing) else str(tmp_path / "empty") for a in args])
    assert code == 2 and "is not a host's root (it has no sys/bus/pci/devices)" in _one_line_error(out)
