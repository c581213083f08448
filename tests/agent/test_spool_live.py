"""Outages against the real collector over real HTTP: real FP16 training keeps its speed,
the spool replays when the collector comes back, offline files and left-behind spools
upload, and the database ends up holding every record exactly once."""

from __future__ import annotations

import functools
import gzip
import json
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

# The training loop is the reliability tests' (`tests/reliability/reliability_support.py`);
# imported by file name, as pytest imports the helper modules beside each test.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))

import pytest
from agent_fakes import wait_for
from reliability_support import Trainer as ReliabilityTrainer

from ampwatch.agent.delivery import DeliveryOptions
from ampwatch.server.cli import main
from ampwatch.server.serving import BackgroundCollector, bind_socket
from ampwatch.server.settings import Settings

STEPS = 300
LAYER_STATS_EVERY = 20
SAMPLED_STEPS = len(range(1, STEPS + 1, LAYER_STATS_EVERY))


#: Probe a returning collector within 0.2 s instead of up to 30 s (the default cap).
QUICK_RETRIES = DeliveryOptions(retry_cap=0.2)


class Trainer(ReliabilityTrainer):
    """The reliability tests' FP16 loop with one hidden layer of 256, layer statistics
    every `LAYER_STATS_EVERY` steps."""

    def __init__(self) -> None:
        super().__init__(width=256, depth=1)

    def watch(self, **kwargs: Any) -> Any:
        return super().watch(layer_stats_every=LAYER_STATS_EVERY, **kwargs)


def _free_port() -> int:
    sock = bind_socket()
    port = int(sock.getsockname()[1])
    sock.close()  # nothing listens there now
    return port


def _collector(
    port: int, database_url: str, sock: socket.socket | None = None
) -> BackgroundCollector:
    return BackgroundCollector(
        Settings(port=port, database_url=database_url, dashboard=False), sock=sock
    )


def _down_collector() -> tuple[socket.socket, int]:
    """A port where a collector is down: bound but not listening, so a connection is
    refused, and held, so no other process (a parallel test's server or client) can take
    it before the collector comes up on it (`_collector(port, url, sock)`)."""
    sock = bind_socket()
    return sock, int(sock.getsockname()[1])


def _query(database_url: str, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(database_url.removeprefix("sqlite:///")) as db:
        return db.execute(sql).fetchall()


def _run_ended(database_url: str) -> bool:
    try:
        return bool(_query(database_url, "SELECT 1 FROM events WHERE kind = 'run_end'"))
    except sqlite3.OperationalError:  # no schema yet
        return False


def _assert_stored_exactly_once(database_url: str) -> None:
    """Every step, sampled step and event once; every batch once; seqs without gaps."""
    q = functools.partial(_query, database_url)
    assert q("SELECT COUNT(*), COUNT(DISTINCT step), MIN(step), MAX(step) FROM steps") == [
        (STEPS, STEPS, 1, STEPS)
    ]
    assert q("SELECT COUNT(DISTINCT step) FROM layer_stats") == [(SAMPLED_STEPS,)]
    kinds = dict(q("SELECT kind, COUNT(*) FROM events GROUP BY kind"))
    assert kinds.get("run_start") == 1 and kinds.get("run_end") == 1
    assert sum(kinds.values()) == len(q("SELECT DISTINCT kind, step, time FROM events"))
    seqs = [seq for (seq,) in q("SELECT seq FROM ingested_batches ORDER BY seq")]
    assert seqs == list(range(len(seqs)))


def test_collector_down_for_the_whole_run_then_the_spool_arrives_once(
    sqlite_url: str, spool_root: Path
) -> None:
    sock, port = _down_collector()
    trainer, bare_trainer = Trainer(), Trainer()
    bare_trainer.train(50)  # warm-up
    handle = trainer.watch(url=f"http://127.0.0.1:{port}", delivery=QUICK_RETRIES)
    # interleaved, so that both loops see the same load of this shared, noisy machine
    steps = [(trainer.step(), bare_trainer.step()) for _ in range(STEPS)]

    assert handle.step == STEPS
    counters = handle.counters
    assert counters["hook_errors"] == 0 and counters["batches_sent"] == 0
    # The sender thread spools on its own time (after its retries): wait for it, bounded.
    wait_for(lambda: handle.counters["batches_spooled"] >= 1)
    assert list((spool_root / handle.client_run_id).glob("*.spool"))
    # loose: a noisy 2-core machine; the agent's own bar is measured by bench/
    assert statistics.median(w / b for w, b in steps) < 1.5

    with _collector(port, sqlite_url, sock):
        wait_for(lambda: _query(sqlite_url, "SELECT COUNT(*) FROM steps") == [(STEPS,)])
        handle.detach(timeout=10)
        wait_for(lambda: _run_ended(sqlite_url))
    _assert_stored_exactly_once(sqlite_url)
    assert handle.counters["spooled_at_close"] == 0
    assert not list((spool_root / handle.client_run_id).glob("*.spool"))


def test_collector_killed_mid_run_and_restarted_on_the_same_database(sqlite_url: str) -> None:
    sock = bind_socket()
    port = int(sock.getsockname()[1])
    trainer = Trainer()
    first = BackgroundCollector(
        Settings(port=port, database_url=sqlite_url, dashboard=False), sock=sock
    ).start()
    handle = trainer.watch(url=first.url, delivery=QUICK_RETRIES)
    trainer.train(STEPS // 2)
    wait_for(lambda: _query(sqlite_url, "SELECT COUNT(*) FROM steps")[0][0] > 0)
    first.stop()
    trainer.train(STEPS // 2)
    wait_for(lambda: handle.counters["send_failures"] >= 1)  # the sender's own time

    assert handle.counters["send_failures"] >= 1
    with _collector(port, sqlite_url):
        wait_for(lambda: _query(sqlite_url, "SELECT COUNT(*) FROM steps") == [(STEPS,)])
        handle.detach(timeout=10)
        wait_for(lambda: _run_ended(sqlite_url))
    _assert_stored_exactly_once(sqlite_url)


def _upload(path: Path, url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["upload", str(path), "--url", url])
    return code, capsys.readouterr().out


def test_an_offline_file_uploads_completely_and_twice_stores_nothing_twice(
    sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    offline = tmp_path / "run.ampwatch"
    trainer = Trainer()
    handle = trainer.watch(offline_file=offline, url=f"http://127.0.0.1:{_free_port()}")
    trainer.train(STEPS)
    handle.detach(timeout=10)
    assert handle.counters["send_failures"] == 0 and offline.stat().st_size > 0
    batches = len(offline.read_bytes().splitlines())

    sock = bind_socket()
    settings = Settings(port=sock.getsockname()[1], database_url=sqlite_url, dashboard=False)
    with BackgroundCollector(settings, sock=sock) as collector:
        summary = (
            f"{offline} -> {collector.url}: {batches} batches stored, 0 already there, "
            "0 rejected, 0 unreadable, 0 not sent\n"
        )
        assert _upload(offline, collector.url, capsys) == (0, summary)
        code, out = _upload(offline, collector.url, capsys)
        assert code == 0 and f": 0 batches stored, {batches} already there" in out
    _assert_stored_exactly_once(sqlite_url)


def test_a_spool_left_behind_by_an_ended_process_uploads_once(
    sqlite_url: str, spool_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock, port = _down_collector()
    trainer = Trainer()
    handle = trainer.watch(url=f"http://127.0.0.1:{port}", delivery=QUICK_RETRIES)
    trainer.train(STEPS)
    handle.detach(timeout=0.5)  # the collector is still down: everything stays spooled
    assert handle.counters["spooled_at_close"] >= 1

    with _collector(port, sqlite_url, sock) as collector:
        code, out = _upload(spool_root, collector.url, capsys)
        assert code == 0 and "0 not sent" in out
        code, out = _upload(spool_root, collector.url, capsys)
        assert code == 0 and ": 0 batches stored" in out
    _assert_stored_exactly_once(sqlite_url)


_KILLED_TRAINER = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[3])
from reliability_support import Trainer
from ampwatch.agent.delivery import DeliveryOptions
trainer = Trainer(width=64, depth=1)
delivery = DeliveryOptions(retry_cap=0.05, spool_after=1)
handle = trainer.watch(url=sys.argv[1], run_id=sys.argv[2], delivery=delivery)
trainer.train(120)
deadline = time.monotonic() + 20
# Steps keep coming until two batches are spooled: on a loaded machine the sender may seal
# all 120 steps in its first batch, and with nothing new no second batch is ever sealed.
while handle.counters.get("batches_spooled", 0) < 2 and time.monotonic() < deadline:
    trainer.train(1)
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)  # no detach, no atexit: the spool is left behind
"""


def _spooled(folder: Path) -> set[tuple[str, int]]:
    from ampwatch.agent.spool import read_frames

    found = set()
    for segment in folder.glob("*.spool"):
        for body in read_frames(segment):
            if body is not None:
                batch = json.loads(gzip.decompress(body))
                found.add((batch["stream"], batch["seq"]))
    return found


def test_a_spool_left_by_a_killed_process_is_delivered_by_the_next_watch_exactly_once(
    sqlite_url: str, spool_root: Path
) -> None:
    from ampwatch.agent.spool import default_spool_dir

    sock, port = _down_collector()
    url = f"http://127.0.0.1:{port}"
    run_id = "job-7/../resumed"  # a run id with `/` and `..`: its spool stays under the root
    helpers = str(Path(__file__).resolve().parents[1] / "reliability")
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_TRAINER, url, run_id, helpers],
        env={**os.environ, "AMPWATCH_SPOOL_DIR": str(spool_root)}, check=False, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -9
    folder = default_spool_dir(run_id)
    assert folder.parent == spool_root
    left = _spooled(folder)
    assert len(left) >= 2  # batches the killed process could not deliver

    with _collector(port, sqlite_url, sock):
        trainer = Trainer()
        handle = trainer.watch(url=url, run_id=run_id, delivery=QUICK_RETRIES)
        trainer.train(20)
        handle.detach(timeout=20)
    stored = set(_query(sqlite_url, "SELECT stream, seq FROM ingested_batches"))
    assert left <= stored  # every batch the killed process left, delivered ...
    assert list(folder.glob("*.spool")) == []  # ... and its spool gone
    assert len(_query(sqlite_url, "SELECT id FROM runs")) == 1  # into the same run
