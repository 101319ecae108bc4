"""Server settings: defaults < config file (TOML or YAML) < ``GPUMODE_*`` environment < command line."""

from __future__ import annotations

import ipaddress
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from gpumode.cloud.openstack.config import OpenStackConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


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
    log_level: str = Field(default="info", description="one of " + ", ".join(LOG_LEVELS))
    tls_cert: Path | None = Field(default=None, description="PEM certificate (chain) to serve HTTPS with")
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert")
    forwarded_allow_ips: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="reverse proxies whose X-Forwarded-For/-Proto are believed (addresses or CIDRs)",
    )
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

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        if value.lower() not in LOG_LEVELS:
            raise ValueError(f"{value!r} is not one of {', '.join(LOG_LEVELS)}")
        return value.lower()

    @field_validator("forwarded_allow_ips", mode="before")
    @classmethod
    def _split_addresses(cls, value: Any) -> Any:
        # the environment and the command line give one comma-separated string
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for item in value:
            if item == "*":
                continue
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network (or *)") from None
        return value

    @model_validator(mode="after")
    def _cloud_configured(self) -> Settings:
        if self.cloud == "openstack" and self.openstack is None:
            raise ValueError("cloud = openstack needs an [openstack] section (see docs/openstack.md)")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both, or neither")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: {path} is not a readable file")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def advertised_url(self) -> str:
        scheme = "https" if self.tls else "http"
        return self.public_url or f"{scheme}://{self.host}:{self.port}"


SECRET_WORDS = ("password", "secret", "token")
MASK = "********"


def effective(settings: Settings) -> dict[str, Any]:
    """The settings as plain data, secrets masked: any key naming a password, secret or token, and the
    password inside a database URL."""
    data = settings.model_dump(mode="json")
    if "://" in settings.db:
        from sqlalchemy.engine import make_url

        url = make_url(settings.db)
        if url.password is not None:
            data["db"] = url.render_as_string(hide_password=True)
    masked: dict[str, Any] = _mask(data)
    return masked


def _mask(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: MASK if item is not None and any(w in key for w in SECRET_WORDS) else _mask(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_mask(item) for item in value]
    return value


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
