"""The console script: ``--version`` from the one version source, and a missing optional dependency as one
line naming the extra to install (never a traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gpumode
from gpumode.server import db

BLOCK = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
sys.argv = ["gpumode", *{argv!r}]
from gpumode.cli.main import main
main()
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, check=False)


def test_version() -> None:
    result = _run("-m", "gpumode", "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"gpumode {gpumode.__version__}\n"
    # that the package's metadata carries the same version (pyproject reads it from gpumode.__version__) is
    # checked on the built wheel, in tests/deploy/test_package.py


def test_missing_server_extra_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gpumode.db"
    engine = db.make_engine(str(path))
    db.upgrade(engine)
    engine.dispose()
    result = _run("-c", BLOCK.format(module="uvicorn", argv=["server", "--db", str(path), "--port", "1"]))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "gpumode: this command needs the 'uvicorn' package: pip install 'gpumode[server]'"
    ]


def test_missing_pydantic_settings_names_the_server_extra() -> None:
    result = _run("-c", BLOCK.format(module="pydantic_settings", argv=["server", "config", "show"]))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "gpumode: this command needs the 'pydantic_settings' package: pip install 'gpumode[server]'"
    )


def test_a_missing_module_of_our_own_is_a_bug_with_its_traceback() -> None:
    result = _run("-c", BLOCK.format(module="gpumode", argv=["--version"]))
    assert result.returncode == 1 and "Traceback" in result.stderr


def test_help_is_grouped_by_purpose_without_bool_placeholders() -> None:
    top = _run("-m", "gpumode", "--help")
    assert top.returncode == 0, top.stderr
    for panel in ("This host (no server)", "Fleet inventory", "Switching modes", "Fleet administration",
                  "Running gpumode"):  # fmt: skip
        assert panel in top.stdout
    for args in (["--help"], ["server", "--help"], ["switch", "--help"], ["agent", "--help"]):
        result = _run("-m", "gpumode", *args)
        assert result.returncode == 0 and "<bool>" not in result.stdout, result.stdout
    assert "--init " in _run("-m", "gpumode", "server", "--help").stdout
