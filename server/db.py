"""Engine and session factory for SQLite (the embedded default) and PostgreSQL.

SQLite is tuned on every new connection: WAL lets the dashboard read while the collector
writes; `synchronous=NORMAL` is durable across application crashes and much faster than
FULL under WAL; foreign keys are off by default in SQLite. pysqlite's own transaction
handling is replaced by explicit BEGINs (SQLAlchemy's documented recipe) so that a write
transaction can start as `BEGIN IMMEDIATE`: a deferred transaction that reads before it
writes fails at once with "database is locked" when another writer got there first, while
an immediate one waits out `busy_timeout`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

#: Execution option that makes the next transaction on an SQLite connection a writer.
SQLITE_IMMEDIATE = "ampwatch_sqlite_immediate"

SQLITE_BUSY_TIMEOUT_MS = 30_000


def make_engine(database_url: str, **kwargs: Any) -> Engine:
    """Create an engine for `database_url`, creating an SQLite file's folder if needed.

    >>> make_engine("sqlite:///:memory:").dialect.name
    'sqlite'
    """
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, **kwargs)
    if url.database and url.database != ":memory:" and not url.database.startswith("file:"):
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, **kwargs)
    event.listen(engine, "connect", _tune_sqlite)
    event.listen(engine, "begin", _begin_sqlite)
    return engine


def _tune_sqlite(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # SQLAlchemy emits BEGIN itself (_begin_sqlite)
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


def _begin_sqlite(connection: Connection) -> None:
    immediate = connection.get_execution_options().get(SQLITE_IMMEDIATE, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (responses are built after it)."""
    return sessionmaker(engine, expire_on_commit=False)


def begin_write(session: Session) -> None:
    """Start `session`'s transaction as a writer; call before its first statement.

    On SQLite this takes the write lock up front (waiting up to the busy timeout); on
    other databases it is a plain transaction start.
    """
    session.connection(execution_options={SQLITE_IMMEDIATE: True})


def dialect_insert(session: Session, table: Any) -> Any:
    """An INSERT for `table` (a model or Table) supporting ON CONFLICT, from the session's
    dialect: both backends spell upserts the same way, but through different classes."""
    return insert_for(session.get_bind().dialect.name, table)


def insert_for(dialect: str, table: Any) -> Any:
    """`dialect_insert` by dialect name, for statements built once per dialect."""
    from sqlalchemy.dialects import postgresql, sqlite

    if dialect == "sqlite":
        return sqlite.insert(table)
    if dialect == "postgresql":
        return postgresql.insert(table)
    raise RuntimeError(f"ampwatch stores into SQLite or PostgreSQL, not {dialect}")
