"""Engine and session factory for SQLite (the embedded default) and PostgreSQL, and the
bulk upsert both dialects take.

SQLite is tuned on every new connection: WAL lets the dashboard read while the collector
writes; `synchronous=NORMAL` is durable across application crashes and much faster than
FULL under WAL; foreign keys are off by default in SQLite. pysqlite's own transaction
handling is replaced by explicit BEGINs (SQLAlchemy's documented recipe) so that a write
transaction can start as `BEGIN IMMEDIATE`: a deferred transaction that reads before it
writes fails at once with "database is locked" when another writer got there first, while
an immediate one waits out `busy_timeout`.

Every JSON column is written with `wire.dumps` (both backends): NaN and +-Inf in the wire's
spelling, never the bare tokens PostgreSQL's json refuses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, Table, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from ampwatch.agent.wire import dumps

#: Execution option that makes the next transaction on an SQLite connection a writer.
SQLITE_IMMEDIATE = "ampwatch_sqlite_immediate"

SQLITE_BUSY_TIMEOUT_MS = 30_000


def make_engine(database_url: str, **kwargs: Any) -> Engine:
    """Create an engine for `database_url`, creating an SQLite file's folder if needed.

    >>> make_engine("sqlite:///:memory:").dialect.name
    'sqlite'
    """
    url = make_url(database_url)
    # Every JSON column in the wire's encoding of NaN/+-Inf (`wire.dumps`), on both backends.
    kwargs.setdefault("json_serializer", dumps)
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, **kwargs)
    if url.database and url.database != ":memory:" and not url.database.startswith("file:"):
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, **kwargs)
    event.listen(engine, "connect", _tune_sqlite)
    turns = _WriterTurns()
    event.listen(engine, "begin", turns.begin)
    event.listen(engine, "commit", turns.end)
    event.listen(engine, "rollback", turns.end)
    return engine


def _tune_sqlite(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # SQLAlchemy emits BEGIN itself (_WriterTurns.begin)
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


#: `Connection.info` key: this connection's transaction holds its engine's writer turn.
_HOLDS_TURN = "ampwatch_writer_turn"


class _WriterTurns:
    """The writers of one SQLite engine (`begin_write`) take turns on a lock of this
    process before `BEGIN IMMEDIATE`, and hand it on at commit or rollback.

    Why: a writer waiting for SQLite's lock waits in SQLite's busy handler, which polls
    with sleeps that grow to 25-100 ms: after each commit the write lock sat idle while
    the next writer slept, and with batches of ~20 ms the waits outlasted the work. A
    lock of the process wakes the next writer at once. Writers of other processes (the
    CLI, a second collector) still meet at SQLite's lock. A turn not had within the busy
    timeout (a writer nested in another on one thread) goes on to SQLite's lock as before.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def begin(self, connection: Connection) -> None:
        immediate = connection.get_execution_options().get(SQLITE_IMMEDIATE, False)
        if immediate and self._lock.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000):
            connection.info[_HOLDS_TURN] = True
        try:
            connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
        except BaseException:
            self.end(connection)
            raise

    def end(self, connection: Connection) -> None:
        if connection.info.pop(_HOLDS_TURN, False):
            self._lock.release()


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (responses are built after it)."""
    return sessionmaker(engine, expire_on_commit=False)


def lookup_connections(engine: Engine) -> Callable[[], Connection]:
    """Connections for lookups whose statements need no common snapshot and write nothing
    (who is calling, `api.deps.resolve_caller`): Core connections, not sessions (the
    caller's token and path run, SQLite, in-process: 116 -> 79 us of CPU), and on
    PostgreSQL in autocommit, without the BEGIN and ROLLBACK round trips around them (a
    lookup of two statements: 735 -> 630 us of this process's CPU, 1145 -> 853 us wall,
    interleaved, besides the server's own work). SQLite's are a plain transaction: there a
    statement outside one takes and drops its read lock itself, and the lookup cost more
    (269 -> 330 us)."""
    if engine.dialect.name != "sqlite":
        engine = engine.execution_options(isolation_level="AUTOCOMMIT")
    return engine.connect


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


def upsert(
    session: Session,
    model: type[DeclarativeBase],
    columns: Sequence[str],
    rows: list[tuple[Any, ...]],
    key: Sequence[str],
) -> None:
    """INSERT ... ON CONFLICT (key) DO UPDATE: the last write of a key wins. Here, next to
    `dialect_insert`, because it is storage, not ingest: ingest's bulk writes (steps, packed
    layer rows, layer rollups, histograms) go through it, and so does `bench/query.py`'s
    bulk population, which stores packed rows without a wire batch.

    `rows` are tuples in `columns` order, already converted for the database (no key twice:
    one statement may not update a row twice). On PostgreSQL the rows travel as one array
    per column through `unnest`: one statement and one round trip, ~3x faster per batch
    than psycopg's pipelined executemany (whose per-row Python cost dominated profiles).
    SQLite, in process, takes a plain executemany.

    >>> upsert(session, Step, ("run_id", "rank", "step", "loss"), [(1, 0, 7, 2.5)],
    ...        key=("run_id", "rank", "step"))  # doctest: +SKIP
    """
    if not rows:
        return
    table = model.__table__
    assert isinstance(table, Table)  # a mapped class, not a select
    connection = session.connection()
    dialect = connection.dialect
    quote = dialect.identifier_preparer.quote  # `values` is a reserved word
    names = ", ".join(quote(c) for c in columns)
    updates = ", ".join(f"{quote(c)} = excluded.{quote(c)}" for c in columns if c not in key)
    conflict = f"ON CONFLICT ({', '.join(quote(c) for c in key)}) DO UPDATE SET {updates}"
    if dialect.name == "postgresql":
        arrays = ", ".join(f"%b::{table.c[c].type.compile(dialect=dialect)}[]" for c in columns)
        sql = f"INSERT INTO {table.name} ({names}) SELECT * FROM unnest({arrays}) {conflict}"
        connection.exec_driver_sql(sql, tuple(list(column) for column in zip(*rows)))
        return
    marks = ", ".join(["?"] * len(columns))
    sql = f"INSERT INTO {table.name} ({names}) VALUES ({marks}) {conflict}"
    connection.exec_driver_sql(sql, rows)
