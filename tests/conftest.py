"""Fixtures shared by every test package: fresh databases and a live collector.

- `sqlite_url`: SQLAlchemy URL of an empty SQLite file in the test's tmp_path.
- `postgres_url`: URL of a fresh, uniquely named PostgreSQL database, dropped after the
  test (`fresh_postgres_database`, for other scopes); skipped (never faked) when the
  server is unreachable. The admin connection is
  `AMPWATCH_TEST_POSTGRES` (default postgresql://postgres@127.0.0.1:5432/test).
- `db_url`: both of the above, as two parametrized cases (`[sqlite]`, `[postgres]`; the
  latter marked `postgres`, so `-m "not postgres"` deselects it); `module_db_url` and
  `module_collector` the same per test module, for tests that only read.
- `live_collector` / `live_collector_postgres`: a real collector, see `LiveCollector`.
- `start_collector`: the context manager behind them, for other databases or options:
  `with start_collector(db_url, dashboard=False) as live: ...`.
- `spool_root` (autouse): `AMPWATCH_SPOOL_DIR` inside the test's tmp_path.
- `no_engine_failures` (autouse): fails any test whose collector (in this process: live
  collectors serve in a thread, feeds call ingest directly) logged an alert-engine error,
  unless marked `engine_failures_expected`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from ampwatch.server.serving import BackgroundCollector, bind_socket
from ampwatch.server.settings import Settings

POSTGRES_ADMIN_URL = os.environ.get(
    "AMPWATCH_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test"
)


@dataclass(frozen=True)
class LiveCollector:
    """A collector served by uvicorn on 127.0.0.1 in a background thread.

    `url`: its base URL without a trailing slash (`f"{url}/api/v1/runs"`);
    `database_url`: the SQLAlchemy URL of its database, migrated to head, for tests that
    check what was stored; `settings`: the `Settings` it runs with. The Dash dashboard is
    mounted at `{url}/dashboard/` whenever `ampwatch.dashboard.app` is importable.
    """

    url: str
    database_url: str
    settings: Settings


@pytest.fixture(autouse=True)
def spool_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every agent's default spool directory lives in the test's tmp_path, never ~/.cache:
    any test whose collector is down (or slow to acknowledge) spools there."""
    root = tmp_path / "spool"
    monkeypatch.setenv("AMPWATCH_SPOOL_DIR", str(root))
    return root


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(autouse=True)
def no_engine_failures(request: pytest.FixtureRequest) -> Iterator[None]:
    """0 "alert evaluation ... failed" (or any other alert-engine error) lines in any test's
    collector log: PostgreSQL once refused an alert's Infinity, the engine logged it and
    undid the batch's alerts, and every test still passed."""
    errors = _Errors()
    engine = logging.getLogger("ampwatch.server.alerts")
    engine.addHandler(errors)
    yield
    engine.removeHandler(errors)
    if errors.lines and request.node.get_closest_marker("engine_failures_expected") is None:
        pytest.fail(f"the alert engine logged {len(errors.lines)} errors: {errors.lines[:3]}")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ampwatch.db'}"


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """The URL of a new, uniquely named PostgreSQL database, dropped on exit; skips the
    test (never fakes it) when the server is unreachable."""
    psycopg = pytest.importorskip("psycopg")
    from psycopg import sql

    try:
        admin = psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as error:
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_ADMIN_URL}: {error}")
    name = f"ampwatch_test_{uuid.uuid4().hex[:12]}"
    with admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg", database=name)
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
            # FORCE: a pooled connection a failing test left open must not leak the database.
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def module_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """As `db_url`, one database per test module: for tests that only read what a
    module-scoped fixture stored once (`module_collector`)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'ampwatch.db'}"
        return
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture(scope="module")
def module_collector(module_db_url: str) -> Iterator[LiveCollector]:
    """A collector without the dashboard over `module_db_url`, shared by a module's tests:
    populating a long run once instead of per test (~9 s each)."""
    with serve_collector(module_db_url, dashboard=False) as collector:
        yield collector


@contextmanager
def serve_collector(
    database_url: str, *, dashboard: bool, **settings: Any
) -> Iterator[LiveCollector]:
    """Migrate `database_url`, serve a collector over it, stop it on exit.

    `settings` are further `Settings` fields, e.g. `max_body_bytes=1024`.
    """
    sock = bind_socket()
    config = Settings(
        database_url=database_url, port=sock.getsockname()[1], dashboard=dashboard, **settings
    )
    with BackgroundCollector(config, sock=sock):
        yield LiveCollector(url=config.public_url, database_url=database_url, settings=config)


@pytest.fixture
def start_collector() -> Callable[..., AbstractContextManager[LiveCollector]]:
    """`serve_collector` as a fixture: `with start_collector(url, dashboard=False) as live`."""
    return serve_collector


def _dashboard_available() -> bool:
    return importlib.util.find_spec("ampwatch.dashboard.app") is not None


@pytest.fixture
def live_collector(sqlite_url: str) -> Iterator[LiveCollector]:
    """A real collector over a fresh SQLite file; yields a `LiveCollector`."""
    with serve_collector(sqlite_url, dashboard=_dashboard_available()) as collector:
        yield collector


@pytest.fixture
def live_collector_postgres(postgres_url: str) -> Iterator[LiveCollector]:
    """As `live_collector`, over a fresh PostgreSQL database (skipped when unreachable)."""
    with serve_collector(postgres_url, dashboard=_dashboard_available()) as collector:
        yield collector
