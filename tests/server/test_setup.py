"""Settings layering, database URLs, migrations that match the models, and ``gpumode server --init``."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect
from typer.testing import CliRunner

from gpumode.cli.main import app as cli
from gpumode.server import db
from gpumode.server.models import Base
from gpumode.server.settings import SettingsError, load_settings


def test_settings_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "gpumode.toml"
    toml.write_text('[server]\nport = 9000\nhost = "0.0.0.0"\ndb = "/var/lib/gpumode/db.sqlite"\n')
    assert load_settings(toml).port == 9000
    monkeypatch.setenv("GPUMODE_PORT", "9100")
    assert load_settings(toml).port == 9100  # environment beats the file
    assert load_settings(toml, port=9200).port == 9200  # an option beats both
    assert load_settings(toml).host == "0.0.0.0"
    yaml = tmp_path / "gpumode.yaml"
    yaml.write_text("metrics_public: true\n")
    assert load_settings(yaml).metrics_public is True


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.toml", "prot = 1\n", "unknown setting(s) prot"),
        ("a.toml", "port = 'x'\n", "port"),
        ("a.toml", "port = [\n", "not valid"),
        ("a.ini", "port=1\n", ".toml, .yaml"),
        ("a.yaml", "- 1\n", "table of settings"),
    ],
)
def test_bad_config_is_named(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(
        SettingsError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    ):
        load_settings(path)


def test_database_urls(tmp_path: Path) -> None:
    assert db.database_url(str(tmp_path / "x.db")).drivername == "sqlite"
    assert db.database_url("postgresql://u@h/d").drivername == "postgresql+psycopg"
    with pytest.raises(db.DatabaseUrlError, match="unsupported database 'mysql'"):
        db.database_url("mysql://u@h/d")


def test_migrations_match_the_models(engine: Engine) -> None:
    """``upgrade head`` produces exactly the schema the models describe, on SQLite and PostgreSQL."""
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []
    assert db.current_revision(engine) == ScriptDirectory.from_config(db.alembic_config()).get_current_head()
    db.upgrade(engine)  # idempotent
    assert set(Base.metadata.tables) <= set(inspect(engine).get_table_names())


def test_sqlite_uses_wal(tmp_path: Path) -> None:
    engine = db.make_engine(str(tmp_path / "w.db"))
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()


def test_cli_init_creates_database_and_prints_tokens(tmp_path: Path) -> None:
    path = tmp_path / "state" / "gpumode.db"
    result = CliRunner().invoke(cli, ["server", "--init", "--db", str(path), "--port", "8443"])
    assert result.exit_code == 0, result.output
    assert (
        "gpmu_" in result.output
        and "gpumode agent --server http://127.0.0.1:8443 --token gpmj_" in result.output
    )
    engine = db.make_engine(str(path))
    assert db.current_revision(engine) == ScriptDirectory.from_config(db.alembic_config()).get_current_head()
    engine.dispose()
    again = CliRunner().invoke(cli, ["server", "--init", "--db", str(path)])
    assert again.exit_code == 0 and "additional tokens" in again.output


def test_cli_bad_config_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "x.toml"
    bad.write_text("nope = 1\n")
    result = CliRunner().invoke(cli, ["server", "--config", str(bad)])
    assert result.exit_code == 2 and "unknown setting(s) nope" in result.output


def test_cli_workers_need_postgresql(tmp_path: Path) -> None:
    """Several processes on one SQLite file would serialise on its lock: refused before anything starts."""
    path = tmp_path / "gpumode.db"
    result = CliRunner().invoke(cli, ["server", "--db", str(path), "--workers", "2"])
    assert result.exit_code == 2 and "--workers needs PostgreSQL" in result.output
    assert not path.exists()


def test_worker_app_takes_the_settings_its_parent_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumode.cli import server as server_cli

    settings = load_settings(None, db="postgresql+psycopg://gpumode@db/gpumode", port=9300)
    monkeypatch.setenv("GPUMODE_WORKER_SETTINGS", settings.model_dump_json())
    app = server_cli.worker_app()
    assert app.state.gpumode.settings.model_dump() == settings.model_dump()
    app.state.gpumode.engine.dispose()
