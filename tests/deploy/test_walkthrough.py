"""docs/deploy.md, walked through with this checkout's gpumode: a private CA, the server over TLS from its
config file, ``--init``, the checks (curl and ``gpumode nodes`` verifying with ``--ca``), an agent joining
over TLS from agent.toml, ``migrate``, and an SQLite backup restored. (tests/deploy/test_package.py walks the
same blocks with gpumode installed from its wheel.)"""

from __future__ import annotations

import json
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from gpumode.tls import verify_context

from .walkthrough import Site, admin_token, join_token, unit_command, wait_for

PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    if shutil.which("openssl") is None or shutil.which("curl") is None or shutil.which("sqlite3") is None:
        pytest.fail("openssl, curl and sqlite3 are needed: run scripts/install-system-deps.sh", pytrace=False)
    prefix = tmp_path / "opt/gpumode"
    (prefix / "bin").mkdir(parents=True)
    binary = prefix / "bin/gpumode"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} -m gpumode "$@"\n')  # this checkout's gpumode
    binary.chmod(0o755)
    here = Site(tmp_path, prefix)
    yield here
    here.stop_server()


def serve(site: Site) -> str:
    """The doc's TLS, server.toml and init blocks, then the server unit's command; the admin token."""
    site.run_block("tls")
    site.write_block("server.toml", site.root / "etc/gpumode/server.toml")
    init = site.run_block("init")
    assert f"gpumode agent --server {site.url} --token gpmj_" in init.stdout and "--ca" in init.stdout
    site.start_server()
    return admin_token(init.stdout)


def test_server_over_tls_verified_with_the_ca(site: Site) -> None:
    admin = serve(site)
    check = site.run_block("check", env={"GPUMODE_ADMIN_TOKEN": admin})
    assert check.stdout.startswith('{"status":"ok"}')  # curl's, without a newline
    assert "no nodes have joined yet" in check.stdout
    # without the CA the certificate is not trusted: verification really happens
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{site.url}/healthz", verify=verify_context(None), timeout=5)
    gpumode = str(site.prefix / "bin/gpumode")
    refused = subprocess.run(
        [gpumode, "nodes", "--server", site.url, "--token", admin],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode == 5, refused.stderr
    assert "certificate verify failed" in refused.stderr and "Traceback" not in refused.stderr
    bad_ca = subprocess.run(
        [gpumode, "nodes", "--server", site.url, "--token", admin, "--ca", str(site.root / "nope.pem")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad_ca.returncode == 2 and "nope.pem does not exist" in bad_ca.stderr


@pytest.mark.slow  # about 20 s: an emulated host, an agent joining
def test_agent_joins_over_tls_from_agent_toml(site: Site, tmp_path: Path) -> None:
    site.run_block("tls")
    site.write_block("server.toml", site.root / "etc/gpumode/server.toml")
    init = site.run_block("init")
    admin = admin_token(init.stdout)
    site.start_server()
    shutil.copy(site.ca, site.root / "etc/gpumode/ca.pem")  # "copy ca.pem to every GPU host"
    site.extra['"gpmj_…"'] = json.dumps(join_token(init.stdout))
    site.write_block("agent.toml", site.root / "etc/gpumode/agent.toml")
    host = tmp_path / "host"
    gpumode = [sys.executable, "-m", "gpumode"]
    subprocess.run([*gpumode, "emulate", "create", "rtx-workstation", str(host)], check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    command = [*shlex.split(site.swap(unit_command("gpumode-agent.service"))), "--root", str(host)]
    log = (tmp_path / "agent.log").open("ab")
    agent = subprocess.Popen(command, stdout=log, stderr=log)
    try:

        def joined() -> bool:
            if agent.poll() is not None:
                raise AssertionError("the agent exited:\n" + (tmp_path / "agent.log").read_text()[-3000:])
            try:
                nodes = site.api("GET", "/nodes", admin).json()
            except httpx.TransportError:  # a busy machine: ask again
                return False
            return bool(nodes) and nodes[0]["gpu_count"] == 1

        wait_for(joined, 90, "the agent to join over TLS")
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(60)
    stored = json.loads((host / "etc/gpumode/agent.json").read_text())
    assert stored["server"] == site.url and stored["token"].startswith("gpmn_")


def test_migrate_and_sqlite_backup_restore(site: Site) -> None:
    admin = serve(site)
    assert site.api("PUT", "/groups/rack-a", admin, json={"nodes": []}).status_code == 200
    site.run_block("backup-sqlite")
    assert site.api("PUT", "/groups/rack-b", admin, json={"nodes": []}).status_code == 200
    site.stop_server()
    site.run_block("restore-sqlite")
    assert (site.root / "systemctl.log").read_text().splitlines()[-2:] == [
        "stop gpumode-server",
        "start gpumode-server",
    ]
    migrate = site.run_block("migrate")
    assert "is up to date" in migrate.stdout
    site.start_server()
    groups = site.api("GET", "/groups", admin).json()
    assert [g["name"] for g in groups] == ["rack-a"]  # as it was at the backup


@pytest.mark.postgres
def test_postgresql_backup_restore(site: Site) -> None:
    if shutil.which("pg_dump") is None or shutil.which("pg_restore") is None:
        pytest.fail("pg_dump and pg_restore are needed: run scripts/install-system-deps.sh", pytrace=False)
    name = f"gpumode_deploy_{secrets.token_hex(4)}"
    admin = create_engine(PG_SERVER + "/test", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = f"postgresql://postgres@127.0.0.1:5432/{name}"
    site.extra["postgresql://gpumode@db.example/gpumode"] = url
    init = [str(site.prefix / "bin/gpumode"), "server", "--init", "--db", url]
    try:
        subprocess.run(init, check=True, capture_output=True, timeout=120)
        site.run_block("backup-postgresql")
        subprocess.run(init, check=True, capture_output=True, timeout=120)
        engine = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}")
        count = "SELECT count(*) FROM api_tokens"
        with engine.connect() as conn:
            assert conn.execute(text(count)).scalar() == 2
        site.run_block("restore-postgresql")
        with engine.connect() as conn:
            assert conn.execute(text(count)).scalar() == 1  # as it was at the backup
        engine.dispose()
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
