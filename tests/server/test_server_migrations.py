"""The migrations build exactly the schema the models declare, and undo it."""

from __future__ import annotations

import ast
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


def test_0006_counts_the_steps_of_existing_rollups(db_url: str) -> None:
    """Rollups written before revision 0006 get their bucket's step count from `steps`."""
    from sqlalchemy import text

    migrate.upgrade(db_url, "0005")
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(
                text(
                    "INSERT INTO runs (id, client_run_id, name, project, status, created_at,"
                    " last_seen_at, dropped_steps, dropped_layer_stats, dropped_events, health)"
                    " VALUES (1, 'r', 'r', 'default', 'running', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP,"
                    " 0, 0, 0, 'ok')"
                )
            )
            for step in (1, 2, 5, 70):  # two buckets: 3 steps in [0, 63], 1 in [64, 127]
                connection.execute(
                    text(
                        "INSERT INTO steps (run_id, rank, step, skipped) VALUES (1, 0, :s, false)"
                    ),
                    {"s": step},
                )
            for start, first, last in ((0, 1, 5), (64, 70, 70)):
                connection.execute(
                    text(
                        "INSERT INTO step_rollups (run_id, rank, bucket_start, first_step,"
                        " last_step, skipped_count) VALUES (1, 0, :b, :f, :l, 0)"
                    ),
                    {"b": start, "f": first, "l": last},
                )
        migrate.upgrade(db_url)
        with engine.connect() as connection:
            counts = connection.execute(
                text("SELECT bucket_start, step_count FROM step_rollups ORDER BY bucket_start")
            )
            assert [tuple(row) for row in counts] == [(0, 3), (64, 1)]
    finally:
        engine.dispose()


VERSIONS = Path(__file__).resolve().parents[2] / "alembic" / "versions"


def package_imports(source: str) -> list[str]:
    """Every `ampwatch` module `source` imports, at any depth (a function's lazy import
    counts: it runs with the live code as much as a top-level one).

    >>> package_imports("import os\\ndef f():\\n    from ampwatch.agent.wire import X\\n")
    ['ampwatch.agent.wire']
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [n for n in names if n == "ampwatch" or n.startswith("ampwatch.")]
    return found


def test_migrations_import_nothing_from_the_package() -> None:
    """A migration is a frozen snapshot: one that imports live code (a field tuple, a
    rollup statement) would create something else once that code changes, so an old
    database and a fresh one would differ (issue 30: 0011, 0012 and 0014 did)."""
    migrations = sorted(VERSIONS.glob("*.py"))
    assert len(migrations) >= 15
    offenders = {
        path.name: imports
        for path in migrations
        if (imports := package_imports(path.read_text(encoding="utf-8")))
    }
    assert offenders == {}
