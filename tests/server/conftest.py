"""Collector test fixtures: a live collector on each backend, an HTTP client, row counts.

Tests talk HTTP to a real uvicorn server (starlette's TestClient is deprecated with
httpx), so what they check is what an agent or the dashboard would see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from alert_feed import Feed
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server import migrate
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.models import Base


@pytest.fixture
def collector(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> Iterator[Any]:
    """A `LiveCollector` without the dashboard over a fresh, migrated database."""
    with start_collector(db_url, dashboard=False) as live:
        yield live


@pytest.fixture
def client(collector: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=collector.url, timeout=30) as http:
        yield http


@pytest.fixture
def count_rows(collector: Any) -> Iterator[Callable[[], dict[str, int]]]:
    """Row counts of every table, to prove that a rejected batch stored nothing."""
    engine = make_engine(collector.database_url)

    def counts() -> dict[str, int]:
        with engine.connect() as connection:
            return {
                name: connection.scalar(select(func.count()).select_from(table)) or 0
                for name, table in Base.metadata.tables.items()
            }

    yield counts
    engine.dispose()


@pytest.fixture
def sessions(db_url: str) -> Iterator[sessionmaker[Session]]:
    """Sessions on a fresh, migrated database, for tests that call ingest in-process."""
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def feed(db_url: str) -> Iterator[Feed]:
    """Wire batches fed through ingest and the alert engine on a fresh, migrated database."""
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    yield Feed(make_sessionmaker(engine))
    engine.dispose()
