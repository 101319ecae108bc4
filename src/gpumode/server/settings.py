"""Server settings: defaults < config file (TOML or YAML) < ``GPUMODE_*`` environment < command line."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from gpumode.cloud.openstack.config import OpenStackConfig


class SettingsError(ValueError):
    """The configuration file or an option is wrong; the message names what."""


class Settings(BaseSettings):
    """Everything the server reads at start. ``db`` is a SQLAlchemy URL or a plain file path (SQLite)."""

    model_config = SettingsConfigDict(env_prefix="GPUMODE_", extra="forbid")

    db: str = Field(default="gpumode.db", description="SQLAlchemy URL or SQLite file path")
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    public_url: str | None = Field(
        default=None, description="URL agents use to reach this server (for join instructions)"
    )
    metrics_public: bool = Field(default=False, description="serve /metrics without a token")
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="larger request bodies are refused (413)"
    )
    db_pool_size: int = Field(default=10, ge=1, le=200)
    log_level: str = "info"
    cloud: Literal["embedded", "openstack"] = Field(
        default="embedded", description="where cards are offered: gpumode's own DB, or OpenStack"
    )
    openstack: OpenStackConfig | None = Field(default=None, description="the [openstack] section")

    @field_validator("db")
    @classmethod
    def _db_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("db must be a SQLAlchemy URL or a file path")
        return value.strip()

    @model_validator(mode="after")
    def _cloud_configured(self) -> Settings:
        if self.cloud == "openstack" and self.openstack is None:
            raise ValueError("cloud = openstack needs an [openstack] section (see docs/openstack.md)")
        return self

    @property
    def advertised_url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML or YAML config file (by extension); keys are the setting names, optionally under
    ``[server]``.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif path.suffix in {".yaml", ".yml"}:
            data = yaml.safe_load(text) or {}
        else:
            raise SettingsError(f"config file {path}: expected a .toml, .yaml or .yml file")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise SettingsError(f"config file {path} is not valid: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path}: expected a table of settings at the top level")
    if isinstance(data.get("server"), dict) and set(data) <= {"server", "openstack"}:
        data = {**data["server"], **({"openstack": data["openstack"]} if "openstack" in data else {})}
    unknown = sorted(set(data) - set(Settings.model_fields))
    if unknown:
        raise SettingsError(
            f"config file {path}: unknown setting(s) {', '.join(unknown)}; "
            f"known: {', '.join(Settings.model_fields)}"
        )
    return dict(data)


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build settings from all sources; ``overrides`` set to ``None`` are ignored (an option not given)."""
    file_values = read_config_file(config_file) if config_file is not None else {}
    given = {k: v for k, v in overrides.items() if v is not None}

    class _Layered(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, InitSettingsSource(settings_cls, init_kwargs=file_values))

    try:
        return _Layered(**given)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from exc


def _describe(exc: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
    return "invalid settings: " + "; ".join(parts)
