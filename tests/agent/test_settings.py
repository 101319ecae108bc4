"""``gpumode agent --config agent.toml``: defaults < file < GPUMODE_AGENT_* < options; unknown keys and bad
values are refused with the key and its source named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpumode.agent.settings import MASK, AgentSettingsError, load_agent_settings
from gpumode.cli.main import app as cli


def test_layers(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('[agent]\nserver = "https://gpumode.example:8443"\ninterval = 30\ncheck = 2\n')
    env = {"GPUMODE_AGENT_INTERVAL": "45", "GPUMODE_AGENT_APPLY_DESIRED": "false"}
    settings = load_agent_settings(config, env, check=1.5)
    assert settings.server == "https://gpumode.example:8443"  # file
    assert settings.interval == 45.0  # the environment beats the file
    assert settings.check == 1.5  # an option beats both
    assert settings.apply_desired is False
    assert settings.wait == 25.0 and settings.root == Path("/")  # defaults


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ('server = "https://x"\nintervall = 3\n', {}, "unknown key(s) intervall"),
        ('server = "https://x"\nwait = 90\n', {}, "wait (from {config}) must be between 1 and 60"),
        (
            'server = "https://x"\n',
            {"GPUMODE_AGENT_CHECK": "soon"},
            "check (from GPUMODE_AGENT_CHECK) must be a number",
        ),
        ('server = "gpumode:8080"\n', {}, "is not an http:// or https:// URL"),
        ("interval = 3\n", {}, "no server given"),
        ('server = "https://x"\nca = "/nonexistent/ca.pem"\n', {}, "is not a readable file"),
        ("server = [\n", {}, "not valid TOML"),
    ],
)
def test_refusals_name_the_key(tmp_path: Path, text: str, env: dict[str, str], message: str) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(text)
    with pytest.raises(AgentSettingsError) as caught:
        load_agent_settings(config, env)
    assert message.format(config=config) in str(caught.value)


def test_show_config_masks_the_token(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('server = "https://gpumode.example"\ntoken = "gpmj_secret"\n')
    result = CliRunner().invoke(cli, ["agent", "--config", str(config), "--interval", "90", "--show-config"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["token"] == MASK and "gpmj_secret" not in result.output
    assert shown["interval"] == 90.0 and shown["server"] == "https://gpumode.example"


def test_cli_refusal_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('server = "https://x"\nbogus = 1\n')
    result = CliRunner().invoke(cli, ["agent", "--config", str(config)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"gpumode agent: agent config file {config}: unknown key(s) bogus; known: "
        "server, token, ca, root, interval, check, wait, max_backoff, apply_desired, verbose"
    ]
