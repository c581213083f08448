"""The migrations build exactly the schema the models declare, and undo it."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from ampwatch.server import migrate
from ampwatch.server.db import make_engine
from ampwatch.server.models import Base


def test_upgrade_head_matches_models(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the packaged migrations are found from any directory
    migrate.upgrade(db_url)
    head = ScriptDirectory.from_config(migrate.alembic_config(db_url)).get_current_head()
    engine = make_engine(db_url)
    try:
        with engine.connect() as connection:
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
            assert MigrationContext.configure(connection).get_current_revision() == head
        assert set(inspect(engine).get_table_names()) == set(Base.metadata.tables) | {
            "alembic_version"
        }
    finally:
        engine.dispose()


def test_downgrade_base_leaves_no_tables(db_url: str) -> None:
    migrate.upgrade(db_url)
    migrate.downgrade(db_url, "base")
    engine = make_engine(db_url)
    try:
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    finally:
        engine.dispose()
    migrate.upgrade(db_url)  # and the way back up still works


def test_sqlite_is_tuned_on_connect(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    try:
        with engine.connect() as connection:
            pragma = connection.exec_driver_sql
            assert pragma("PRAGMA journal_mode").scalar() == "wal"
            assert pragma("PRAGMA foreign_keys").scalar() == 1
            assert pragma("PRAGMA synchronous").scalar() == 1  # NORMAL
            assert pragma("PRAGMA busy_timeout").scalar() > 0
    finally:
        engine.dispose()
