"""The ingest process (`server/ingest_pool.py`, `server/ingest_worker.py`): batches are
stored by a process of their own, which a collector replaces when it dies and stops when
the collector stops; what it logs and answers reaches the collector's process."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from wire_batches import make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server import ingest_worker
from ampwatch.server.ingest_pool import PROCESS_DIED, yield_cpu_to_ingest
from ampwatch.server.main import create_app
from ampwatch.server.migrate import upgrade
from ampwatch.server.serving import BackgroundCollector, bind_socket
from ampwatch.server.settings import Settings

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while listed
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def ingest_processes() -> set[int]:
    """The live ingest processes of this test process's collectors: children of the fork
    server (`ingest_pool._context`) that it started."""
    return {child for server in _children(os.getpid()) for child in _children(server)}


@pytest.fixture
def collector(db_url: str) -> Iterator[BackgroundCollector]:
    sock = bind_socket()
    settings = Settings(
        database_url=db_url, port=sock.getsockname()[1], dashboard=False, ingest_processes=1
    )
    with BackgroundCollector(settings, sock=sock) as live:
        yield live


def _post(url: str, seq: int) -> httpx.Response:
    batch = make_batch(seq, steps=[step_record(seq * 10 + i, loss=1.0) for i in range(1, 4)])
    return httpx.post(f"{url}{INGEST_PATH}", content=json.dumps(batch), timeout=30)


def test_batches_are_stored_by_a_process_of_their_own(collector: BackgroundCollector) -> None:
    (process,) = ingest_processes()
    assert process != os.getpid()
    assert _post(collector.url, 0).json()["duplicate"] is False
    assert ingest_processes() == {process}  # the same one, batch after batch
    assert _post(collector.url, 1).json()["duplicate"] is False
    (run,) = httpx.get(f"{collector.url}/api/v1/runs").json()["runs"]
    assert run["steps"] == 6


def test_reads_yield_the_cpu_to_the_ingest_process(collector: BackgroundCollector) -> None:
    """The collector's event loop (and the threads it starts) runs `read_niceness` (10)
    below the ingest process, and only once: a second lifespan in the same thread does not
    lower it again."""
    (loop,) = [t for t in threading.enumerate() if t.name == "ampwatch-collector"]
    assert loop.native_id is not None
    (process,) = ingest_processes()
    ingest = os.getpriority(os.PRIO_PROCESS, process)
    if ingest > 9:  # the suite itself runs under `nice`: no room below to check
        pytest.skip(f"the ingest process runs at nice {ingest}: nothing below it to check")
    assert os.getpriority(os.PRIO_PROCESS, loop.native_id) == ingest + 10


def test_a_thread_is_lowered_below_the_ingest_process_once() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base > 14:  # the suite itself runs under `nice`
        pytest.skip(f"this thread runs at nice {base}: it cannot be lowered by 5 to check")
    seen: list[int] = []

    def look() -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, 0))

    def lowered() -> None:
        yield_cpu_to_ingest(5, base)
        look()
        yield_cpu_to_ingest(5, base)  # a second collector's lifespan
        look()
        yield_cpu_to_ingest(5, base - 5)  # already lower than asked: left as it is
        look()
        yield_cpu_to_ingest(0, base)  # read_niceness 0: reads as high as ingest
        look()

    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    assert seen == [base + 5] * 4
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # a thread's own, on Linux


def test_a_killed_ingest_process_is_replaced_and_its_batch_retried(
    collector: BackgroundCollector, caplog: pytest.LogCaptureFixture
) -> None:
    assert _post(collector.url, 0).status_code == 200
    (killed,) = ingest_processes()
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while killed in ingest_processes() and time.monotonic() < deadline:
        time.sleep(0.01)
    refused = _post(collector.url, 1)
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json() == {"detail": PROCESS_DIED}
    assert "an ingest process stopped; a new one takes the next batch" in caplog.text
    retried = _post(collector.url, 1)  # what the agent does with a 503
    assert retried.status_code == 200 and retried.json()["duplicate"] is False
    (replacement,) = ingest_processes()
    assert replacement != killed
    (run,) = httpx.get(f"{collector.url}/api/v1/runs").json()["runs"]
    assert run["steps"] == 6  # both batches, once


def test_the_collector_stops_its_ingest_processes(db_url: str) -> None:
    sock = bind_socket()
    settings = Settings(
        database_url=db_url, port=sock.getsockname()[1], dashboard=False, ingest_processes=1
    )
    with BackgroundCollector(settings, sock=sock) as live:
        started = ingest_processes()
        assert _post(live.url, 0).status_code == 200
    assert len(started) == 1
    assert not started & ingest_processes()


def test_log_records_of_a_call_travel_back_and_are_emitted_under_their_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kept = ingest_worker.Kept()
    logger = logging.getLogger("ampwatch.server.ingest")
    logger.addHandler(kept)
    logger.propagate = False  # as in the ingest process, where `Kept` is the one handler
    try:
        try:
            raise ValueError("a rule's arithmetic")
        except ValueError:
            logger.exception("alert rule %s of run %s failed", "loss_spike", 7)
        logger.info("below the level sent back")
    finally:
        logger.removeHandler(kept)
        logger.propagate = True
    records = pickle.loads(pickle.dumps(tuple(kept.records)))  # as the answer travels
    assert len(records) == 1
    with caplog.at_level(logging.ERROR, logger="ampwatch.server"):
        ingest_worker.replay(records)
    (record,) = [r for r in caplog.records if r.name == "ampwatch.server.ingest"]
    assert record.getMessage() == "alert rule loss_spike of run 7 failed"
    assert record.levelno == logging.ERROR
    assert "ValueError: a rule's arithmetic" in caplog.text  # the traceback, as text


class _FakePool:
    def __init__(self, outcome: ingest_worker.Outcome) -> None:
        self.outcome = outcome
        self.calls: list[ingest_worker.Call] = []

    async def submit(self, call: ingest_worker.Call) -> ingest_worker.Outcome:
        self.calls.append(call)
        return self.outcome


@pytest.mark.parametrize(
    ("outcome", "status", "body", "header"),
    [
        (ingest_worker.Stored(b'{"run_id":1}', False, 3, 8, False), 200, {"run_id": 1}, None),
        (ingest_worker.Refused(422, "Invalid JSON"), 422, {"detail": "Invalid JSON"}, None),
        (ingest_worker.Refused(503, "busy", {"Retry-After": "1"}), 503, {"detail": "busy"}, "1"),
        (
            ingest_worker.Failed("RuntimeError"),
            500,
            {"detail": "the batch could not be stored; retry"},
            None,
        ),
    ],
)
def test_the_route_answers_what_the_ingest_process_decided(
    sqlite_url: str, outcome: ingest_worker.Outcome, status: int, body: Any, header: str | None
) -> None:
    """Driven in this process (no lifespan: the ingest process is a fake with an answer)."""
    upgrade(sqlite_url)
    app = create_app(Settings(database_url=sqlite_url, dashboard=False), freeze_heap=False)
    app.state.ingest_pool = pool = _FakePool(outcome)

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 4000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.post(
                INGEST_PATH, content=b"\x1f\x8b...", headers={"Content-Encoding": "GZIP"}
            )

    answer = asyncio.run(post())
    assert (answer.status_code, answer.json(), answer.headers.get("retry-after")) == (
        status,
        body,
        header,
    )
    (call,) = pool.calls
    assert (call.body, call.encoding) == (b"\x1f\x8b...", "GZIP")  # as sent: decoded there
    totals, _ = app.state.ingest_counters.totals()
    assert (totals["batches"], totals["steps"], totals["layer_values"]) == (
        (1, 3, 8) if status == 200 else (0, 0, 0)
    )


def test_a_script_without_a_main_guard_is_told_why_its_collector_did_not_start(
    tmp_path: Path,
) -> None:
    """Its ingest process imports the script's main module, as every multiprocessing start
    but fork does, and so starts another collector there: refused, and said."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from ampwatch.server.serving import BackgroundCollector\n"
        "from ampwatch.server.settings import Settings\n"
        f"settings = Settings(database_url='sqlite:///{tmp_path / 'a.db'}', port=0,"
        " dashboard=False)\n"
        "BackgroundCollector(settings).start().stop()\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert 'a script that starts a collector needs `if __name__ == "__main__":`' in done.stderr
