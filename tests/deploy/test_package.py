"""The package: ``python -m build`` makes a wheel with everything gpumode reads at run time inside; installed
with ``[server]`` into a fresh venv (outside this checkout), it runs docs/deploy.md's install, TLS, init and
check blocks: ``gpumode --version``, ``gpumode server --init``, and a server over TLS answering ``/healthz``
to clients that verify it with the CA.

Marked ``package``: the venv install takes a minute or two (pip's download cache makes reruns faster)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

import gpumode
from gpumode.tls import verify_context

from .walkthrough import REPO, Site, admin_token

pytestmark = [pytest.mark.package, pytest.mark.slow]

INSIDE = [
    "gpumode/data/pci.ids",
    "gpumode/data/catalog.yaml",
    "gpumode/server/alembic.ini",
    "gpumode/server/migrations/env.py",
    "gpumode/server/migrations/script.py.mako",
    "gpumode/server/migrations/versions/0001_initial_schema.py",
    "gpumode/server/web/templates/base.html",
    "gpumode/server/web/templates/job.html",
    "gpumode/server/web/static/app.css",
    "gpumode/server/web/static/job.js",
    "gpumode/emulated/fixtures/hgx_h100.py",
    "gpumode/py.typed",
]


def _run(command: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout,
                            check=False)  # fmt: skip
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_wheel_installs_and_serves_over_tls(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # build from a copy, so a run never writes into the checkout
    source = tmp_path / "source"
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(source)],
         env, tmp_path)  # fmt: skip
    wheel = tmp_path / "dist" / f"gpumode-{gpumode.__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert [n for n in INSIDE if n not in names] == []
    versions = sorted((REPO / "src/gpumode/server/migrations/versions").glob("0*.py"))
    assert {f"gpumode/server/migrations/versions/{v.name}" for v in versions} <= names

    site = Site(tmp_path / "site", tmp_path / "site/opt/gpumode", environ=env)
    site.extra["'gpumode[server]'"] = f"'{wheel}[server]'"
    site.extra["python3 -m venv"] = f"{sys.executable} -m venv"
    try:
        install = site.run_block("install")
        assert install.stdout.strip().endswith(f"gpumode {gpumode.__version__}")
        where = _run([str(site.prefix / "bin/python"), "-c", "import gpumode; print(gpumode.__file__)"],
                     env, tmp_path)  # fmt: skip
        assert where.startswith(str(site.prefix)), where  # the installed copy, not this checkout
        site.run_block("tls")
        site.write_block("server.toml", site.root / "etc/gpumode/server.toml")
        init = site.run_block("init")
        site.start_server()
        check = site.run_block("check", env={"GPUMODE_ADMIN_TOKEN": admin_token(init.stdout)})
        assert check.stdout.startswith('{"status":"ok"}') and "no nodes have joined yet" in check.stdout
        # the dashboard's templates and static files are inside
        tls = verify_context(site.ca)
        page = httpx.get(f"{site.url}/ui/login", verify=tls, timeout=30)
        assert page.status_code == 200 and "<form" in page.text, page.text
        assert httpx.get(f"{site.url}/ui/static/app.css", verify=tls, timeout=30).status_code == 200
    finally:
        site.stop_server()
