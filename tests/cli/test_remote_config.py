"""Where the server URL and token come from (flags > environment > config file), and the error lines for
401, a missing server and a refused connection."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gpumode.cli.client import EXIT_AUTH, EXIT_BAD_INPUT, EXIT_UNREACHABLE, RemoteError, resolve_config

from .remote_support import Fleet, fleet

__all__ = ["fleet"]


def _closed_port_url() -> str:
    """A loopback URL nothing listens on: bind a port, then free it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _config(path: Path, server: str | None = None, token: str | None = None) -> Path:
    lines = [f'{k} = "{v}"' for k, v in (("server", server), ("token", token)) if v is not None]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_config_file_alone_is_enough(fleet: Fleet, tmp_path: Path) -> None:
    cfg = _config(tmp_path / "client.toml", fleet.url, fleet.admin)
    r = fleet.cli("nodes", "--config", str(cfg), token=None, env={"GPUMODE_SERVER": None})
    assert r.exit_code == 0, r.output
    assert "ws-cad-12" in r.stdout


def test_default_config_file_is_read_from_home(fleet: Fleet) -> None:
    _config(fleet.home / ".config/gpumode/client.toml", fleet.url, fleet.tokens["viewer"])
    try:
        r = fleet.cli("nodes", token=None, env={"GPUMODE_SERVER": None})
        assert r.exit_code == 0, r.output
        # the config's token is a viewer's: an admin call is refused, which proves it was used
        r = fleet.cli("token", "list", token=None, env={"GPUMODE_SERVER": None})
        assert r.exit_code == EXIT_AUTH
    finally:
        (fleet.home / ".config/gpumode/client.toml").unlink()


def test_environment_beats_config_and_flags_beat_environment(fleet: Fleet, tmp_path: Path) -> None:
    dead = _closed_port_url()
    cfg = _config(tmp_path / "client.toml", dead, "gpmu_wrong")
    env = {"GPUMODE_CLIENT_CONFIG": str(cfg), "GPUMODE_SERVER": None}

    # config only: its (dead) server is used
    r = fleet.cli("nodes", token=None, env=env)
    assert r.exit_code == EXIT_UNREACHABLE and dead in r.stderr and str(cfg) in r.stderr

    # environment server beats the config's; the config's wrong token is still used → 401
    r = fleet.cli("nodes", token=None, env={**env, "GPUMODE_SERVER": fleet.url})
    assert r.exit_code == EXIT_AUTH and "401" in r.stderr

    # environment token beats the config's
    r = fleet.cli("nodes", env={**env, "GPUMODE_SERVER": fleet.url, "GPUMODE_TOKEN": fleet.admin}, token=None)
    assert r.exit_code == 0, r.output

    # flags beat the environment: a wrong --token is used although the environment's is right
    full = {**env, "GPUMODE_SERVER": fleet.url, "GPUMODE_TOKEN": fleet.admin}
    r = fleet.cli("nodes", "--token", "gpmu_wrong", env=full, token=None)
    assert r.exit_code == EXIT_AUTH
    r = fleet.cli("nodes", "--server", dead, env=full, token=None)
    assert r.exit_code == EXIT_UNREACHABLE
    assert r.stderr.strip() == (
        f"error: cannot connect to the gpumode server at {dead} (from --server): connection refused"
    )
    r = fleet.cli("nodes", "--server", fleet.url, "--token", fleet.admin, env={**env, "GPUMODE_TOKEN": "x"})
    assert r.exit_code == 0


def test_401_without_and_with_a_bad_token(fleet: Fleet) -> None:
    r = fleet.cli("nodes", token=None)
    assert r.exit_code == EXIT_AUTH
    assert r.stderr.startswith("error: 401: missing or invalid bearer token (no token given")
    r = fleet.cli("nodes", token="gpmu_not-a-real-token")
    assert r.exit_code == EXIT_AUTH
    assert r.stderr.strip() == "error: 401: missing or invalid bearer token"


def test_no_server_anywhere(fleet: Fleet) -> None:
    r = fleet.cli("nodes", env={"GPUMODE_SERVER": None})
    assert r.exit_code == EXIT_UNREACHABLE
    assert "no server given: pass --server URL, set GPUMODE_SERVER" in r.stderr


def test_bad_config_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(RemoteError, match="does not exist") as info:
        resolve_config(config_path=missing, environ={})
    assert info.value.exit_code == EXIT_BAD_INPUT

    cfg = tmp_path / "c.toml"
    cfg.write_text('server = "http://x"\npassword = "p"\n')
    with pytest.raises(RemoteError, match=r"unknown key\(s\) password; known: server, token"):
        resolve_config(config_path=cfg, environ={})
    cfg.write_text("server = [1]\n")
    with pytest.raises(RemoteError, match="server must be a string"):
        resolve_config(config_path=cfg, environ={})
    cfg.write_text("server = \n")
    with pytest.raises(RemoteError, match="not valid TOML"):
        resolve_config(config_path=cfg, environ={})
    with pytest.raises(RemoteError, match="is not an http:// or https:// URL"):
        resolve_config(server="gpumode.example:8080", environ={})


def test_resolution_is_per_value(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "c.toml", "http://from-file:1/", "file-token")
    got = resolve_config(config_path=cfg, environ={"GPUMODE_TOKEN": "env-token"})
    assert (got.server, got.server_source) == ("http://from-file:1", str(cfg))
    assert (got.token, got.token_source) == ("env-token", "GPUMODE_TOKEN")
    got = resolve_config(server="http://flag:2", config_path=cfg, environ={"GPUMODE_SERVER": "http://env:3"})
    assert (got.server, got.token) == ("http://flag:2", "file-token")
