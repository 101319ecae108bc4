"""Server settings for a deployment: TLS files, trusted proxies, log level, and ``gpumode server config show``
(every key, secrets masked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpumode.cli.main import app as cli
from gpumode.cli.server import uvicorn_options
from gpumode.server.settings import MASK, SettingsError, load_settings


def test_tls_needs_both_files_that_exist(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    with pytest.raises(SettingsError, match="tls_cert and tls_key go together"):
        load_settings(tls_cert=cert)
    with pytest.raises(SettingsError, match=r"tls_key: .*k\.pem is not a readable file"):
        load_settings(tls_cert=cert, tls_key=key)
    key.write_text("y")
    settings = load_settings(tls_cert=cert, tls_key=key, port=8443)
    assert settings.advertised_url == "https://127.0.0.1:8443"
    options = uvicorn_options(settings)
    assert options["ssl_certfile"] == str(cert) and options["ssl_keyfile"] == str(key)


def test_forwarded_headers_are_believed_only_from_configured_proxies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # uvicorn on its own believes X-Forwarded-* from 127.0.0.1; gpumode believes nobody unless told
    plain = uvicorn_options(load_settings())
    assert plain["proxy_headers"] is False and plain["forwarded_allow_ips"] == []
    monkeypatch.setenv("GPUMODE_FORWARDED_ALLOW_IPS", "10.0.0.5, 192.168.0.0/24")
    proxied = uvicorn_options(load_settings())
    assert proxied["proxy_headers"] is True
    assert proxied["forwarded_allow_ips"] == ["10.0.0.5", "192.168.0.0/24"]
    with pytest.raises(SettingsError, match=r"'proxy\.example' is not an IP address"):
        load_settings(forwarded_allow_ips="proxy.example")


def test_log_level_is_checked() -> None:
    with pytest.raises(SettingsError, match="'loud' is not one of critical"):
        load_settings(log_level="loud")


def test_config_show_prints_every_key_with_secrets_masked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "server.toml"
    config.write_text(
        '[server]\nport = 9000\ndb = "postgresql://gpumode:hunter2@db.example/gpumode"\ncloud = "openstack"\n'
        '[openstack]\nauth_url = "https://keystone.example/v3"\nusername = "gpumode"\npassword = "s3cret"\n'
        'project_name = "service"\n'
    )
    monkeypatch.setenv("GPUMODE_PORT", "9100")
    result = CliRunner().invoke(cli, ["server", "config", "show", "--config", str(config), "--json"])
    assert result.exit_code == 0, result.output
    assert "hunter2" not in result.output and "s3cret" not in result.output
    shown = json.loads(result.output)
    assert shown["port"] == 9100  # the environment beats the file
    assert shown["db"] == "postgresql://gpumode:***@db.example/gpumode"
    assert shown["openstack"]["password"] == MASK and shown["openstack"]["username"] == "gpumode"
    assert {"tls_cert", "tls_key", "forwarded_allow_ips", "log_level"} <= set(shown)
    toml = CliRunner().invoke(cli, ["server", "--port", "9200", "config", "show", "--config", str(config)])
    assert toml.exit_code == 0, toml.output
    assert "[server]\n" in toml.output and "port = 9200" in toml.output and "[openstack]" in toml.output
    assert "s3cret" not in toml.output


def test_config_show_names_an_unknown_key(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text("[server]\ntls_crt = 'x'\n")
    result = CliRunner().invoke(cli, ["server", "config", "show", "--config", str(config)])
    assert result.exit_code == 2 and "unknown setting(s) tls_crt" in result.output
