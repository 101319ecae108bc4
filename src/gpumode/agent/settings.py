"""The agent's settings: defaults < ``--config`` file (TOML) < ``GPUMODE_AGENT_*`` environment < options.

Plain dataclasses and ``tomllib``: the agent runs on every GPU host and needs no pydantic. (The node token the
agent gets by joining is its *state*, kept in ``agent.json`` by :mod:`gpumode.agent.config`.)
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ENV_PREFIX = "GPUMODE_AGENT_"
MASK = "********"


class AgentSettingsError(ValueError):
    """A setting is wrong; the message names the key and where it came from."""


def _meta(help: str, *, minimum: float | None = None, maximum: float | None = None) -> dict[str, Any]:
    return {"help": help, "min": minimum, "max": maximum}


@dataclass(frozen=True, slots=True)
class AgentSettings:
    server: str | None = field(default=None, metadata=_meta("the gpumode server's URL (required)"))
    token: str | None = field(
        default=None, metadata=_meta("a join token (gpmj_…) for the first start; later starts use agent.json")
    )
    ca: Path | None = field(
        default=None, metadata=_meta("PEM CA bundle to verify the server with, instead of the system store")
    )
    root: Path = field(default=Path("/"), metadata=_meta("the host's root (an emulated host's directory)"))
    interval: float = field(
        default=60.0, metadata=_meta("report the host at least every S seconds", minimum=1)
    )
    check: float = field(default=5.0, metadata=_meta("look for changes every S seconds", minimum=0.2))
    wait: float = field(
        default=25.0, metadata=_meta("long-poll for work S seconds at a time", minimum=1, maximum=60)
    )
    max_backoff: float = field(default=30.0, metadata=_meta("longest wait between retries", minimum=0.1))
    apply_desired: bool = field(default=True, metadata=_meta("re-apply the desired state at start"))
    verbose: bool = field(default=False, metadata=_meta("log debug details"))

    def shown(self) -> dict[str, Any]:
        """Every key with its effective value, the token masked."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values = {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}
        if values["token"] is not None:
            values["token"] = MASK
        return values


KEYS = tuple(f.name for f in fields(AgentSettings))


def load_agent_settings(
    config_file: Path | None = None, environ: Mapping[str, str] | None = None, **given: Any
) -> AgentSettings:
    """Layer the sources; a ``given`` value of ``None`` is an option not given."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config_file is not None:
        for key, value in _read(config_file).items():
            values[key], sources[key] = value, str(config_file)
    for key in KEYS:
        name = ENV_PREFIX + key.upper()
        if env.get(name):
            values[key], sources[key] = env[name], name
    for key, value in given.items():
        if key not in KEYS:
            raise TypeError(f"unknown agent setting {key}")
        if value is not None:
            values[key], sources[key] = value, f"--{key.replace('_', '-')}"
    checked = {key: _coerce(key, value, sources[key]) for key, value in values.items()}
    settings = dataclasses.replace(AgentSettings(), **checked)
    if not settings.server:
        raise AgentSettingsError(
            f"no server given: pass --server URL, set {ENV_PREFIX}SERVER, or put server = \"URL\" in the "
            "config file"
        )
    if not settings.server.startswith(("http://", "https://")):
        raise AgentSettingsError(
            f"server {settings.server!r} (from {sources['server']}) is not an http:// or https:// URL"
        )
    if settings.ca is not None and not settings.ca.is_file():
        raise AgentSettingsError(f"ca (from {sources['ca']}): {settings.ca} is not a readable file")
    return settings


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise AgentSettingsError(f"cannot read agent config file {path}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AgentSettingsError(f"agent config file {path} is not valid TOML: {exc}") from exc
    if set(data) == {"agent"} and isinstance(data["agent"], dict):
        data = data["agent"]
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise AgentSettingsError(
            f"agent config file {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}"
        )
    return data


_TYPES = {f.name: f.default for f in fields(AgentSettings)}
_BOUNDS = {f.name: (f.metadata["min"], f.metadata["max"]) for f in fields(AgentSettings)}


def _coerce(key: str, value: Any, source: str) -> Any:
    """``value`` as the key's type (the environment gives strings), within its bounds."""
    default = _TYPES[key]
    try:
        if isinstance(default, bool):
            result: Any = _boolean(value)
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError("a number")
            try:
                result = float(value)
            except ValueError:
                raise ValueError("a number") from None
            low, high = _BOUNDS[key]
            if (low is not None and result < low) or (high is not None and result > high):
                raise ValueError(f"between {low} and {high}" if high is not None else f"at least {low}")
        elif isinstance(default, Path) or key == "ca":
            if not isinstance(value, (str, Path)) or not str(value):
                raise ValueError("a path")
            result = Path(value)
        else:
            if not isinstance(value, str):
                raise ValueError("a string")
            result = value
    except ValueError as exc:
        raise AgentSettingsError(f"{key} (from {source}) must be {exc}, not {value!r}") from None
    return result


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ValueError("true or false")
