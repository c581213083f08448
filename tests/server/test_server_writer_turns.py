"""SQLite writers of one process take turns on a lock before `BEGIN IMMEDIATE`
(`db._WriterTurns`), so the next writer starts as soon as one commits instead of sleeping
in SQLite's busy handler. Real SQLite files, real threads; the orderings are decided by
events the test holds, not by clocks."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from ampwatch.server import db
from ampwatch.server.db import begin_write, make_engine, make_sessionmaker


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    engine = make_engine(f"sqlite:///{tmp_path}/turns.db")
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE log (writer TEXT)")
    return engine


def _log(engine: Engine) -> list[str]:
    with engine.connect() as connection:
        return [row[0] for row in connection.execute(text("SELECT writer FROM log ORDER BY rowid"))]


@pytest.mark.parametrize("end", ["commit", "rollback", "close"])
def test_the_next_writer_starts_when_the_first_ends(engine: Engine, end: str) -> None:
    sessions = make_sessionmaker(engine)
    first = sessions()
    begin_write(first)
    first.execute(text("INSERT INTO log VALUES ('first')"))
    started = threading.Event()
    wrote = threading.Event()

    def second() -> None:
        with sessions() as session:
            started.set()
            begin_write(session)  # waits for the first's turn
            session.execute(text("INSERT INTO log VALUES ('second')"))
            session.commit()
        wrote.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert started.wait(10)
    assert not wrote.wait(0.3)  # still the first's turn
    getattr(first, end)()
    assert wrote.wait(10), "the second writer never got its turn"
    thread.join(10)
    expected = ["first", "second"] if end == "commit" else ["second"]
    assert _log(engine) == expected
    first.close()


def test_a_writer_nested_in_another_on_one_thread_fails_as_before_and_leaks_no_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its turn never comes (the outer writer is on the same thread): after the busy timeout
    it meets SQLite's lock, which refuses it -- as without turns, never a hang."""
    monkeypatch.setattr(db, "SQLITE_BUSY_TIMEOUT_MS", 200)
    engine = make_engine(f"sqlite:///{tmp_path}/nested.db")
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE log (writer TEXT)")
    sessions = make_sessionmaker(engine)
    with sessions() as outer, sessions() as inner:
        begin_write(outer)
        outer.execute(text("INSERT INTO log VALUES ('outer')"))
        with pytest.raises(OperationalError, match="locked"):
            begin_write(inner)
            inner.execute(text("INSERT INTO log VALUES ('inner')"))
        outer.commit()
    with sessions() as later:  # the turn came back: a later writer starts at once
        begin_write(later)
        later.execute(text("INSERT INTO log VALUES ('later')"))
        later.commit()
    assert _log(engine) == ["outer", "later"]
