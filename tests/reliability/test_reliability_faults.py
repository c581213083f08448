"""Faults between a real training loop and a real multi-worker collector on PostgreSQL:
SIGKILL mid-run, SIGKILL in the middle of ingest, a slow collector, a collector answering
5xx. Training must not notice; the database must stay consistent; nothing may be lost
without being counted, and what is counted must reach the server.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from reliability_procs import CollectorProcess, FaultProxy, RowCounter, record_figure, wait_for
from reliability_support import (
    LAYER_STATS_EVERY,
    Trainer,
    assert_exactly_once,
    slowdown,
    stored_run,
    thread_cpu_seconds,
    wire_batch,
)
from sqlalchemy import func, select

from ampwatch.agent.delivery import DeliveryOptions
from ampwatch.agent.wire import INGEST_PATH, LAYER_STATS
from ampwatch.server.layer_models import LayerStat
from ampwatch.server.models import Event, IngestedBatch, Run
from ampwatch.server.step_models import Step

pytestmark = pytest.mark.postgres

STEPS = 240


def _steps_stored(rows: RowCounter) -> int:
    return int(rows.scalar(select(func.count()).select_from(Step)) or 0)


def _run_ended(rows: RowCounter, client_run_id: str) -> bool:
    return rows.scalar(select(Run.status).where(Run.client_run_id == client_run_id)) == "ended"


def _stored_events(rows: RowCounter, client_run_id: str) -> dict[str, Any]:
    """The run's status, its events (kind, step) in stored order, its batches' seqs in
    arrival order."""
    run = select(Run.id).where(Run.client_run_id == client_run_id).scalar_subquery()
    with rows.engine.connect() as connection:
        return {
            "status": connection.scalar(select(Run.status).where(Run.id == run)),
            "events": connection.execute(
                select(Event.kind, Event.step).where(Event.run_id == run).order_by(Event.id)
            ).all(),
            "seqs": connection.scalars(
                select(IngestedBatch.seq)
                .where(IngestedBatch.run_id == run)
                .order_by(IngestedBatch.received_at, IngestedBatch.seq)
            ).all(),
        }


def test_collector_sigkilled_mid_run_and_restarted(
    collector_process: Callable[..., CollectorProcess],
    rows: RowCounter,
) -> None:
    """Supervisor and both workers SIGKILLed a third into the run, restarted at two
    thirds: training runs at its own speed throughout and raises nothing; every step,
    layer sample and event is stored exactly once."""
    first = collector_process(workers=2)
    trainer, bare = Trainer(), Trainer()
    bare.train(30)  # warm-up
    handle = trainer.watch(url=first.url, run="sigkilled", delivery=DeliveryOptions(retry_cap=0.2))
    third = STEPS // 3

    def interleaved(n: int) -> tuple[list[float], list[float], float]:
        """Step times of the watched and the bare loop, and the sender thread's CPU."""
        before = thread_cpu_seconds("ampwatch-sender")
        pairs = [(trainer.step(), bare.step()) for _ in range(n)]
        sender = thread_cpu_seconds("ampwatch-sender") - before
        return [w for w, _ in pairs], [b for _, b in pairs], sender

    up_watched, up_bare, up_cpu = interleaved(third)
    wait_for(lambda: _steps_stored(rows) > 0, what="first steps stored")
    first.kill()
    down_watched, down_bare, down_cpu = interleaved(third)
    collector_process(workers=2, port=first.port)
    interleaved(STEPS - 2 * third)
    handle.detach(timeout=20)
    wait_for(lambda: _run_ended(rows, handle.client_run_id), what="run_end stored")

    counters = handle.counters
    assert counters["hook_errors"] == 0
    assert counters["send_failures"] >= 1  # the kill was felt by the sender, not the loop
    # The outage adds no work: the sender thread (retries, then the spool) uses no more
    # CPU while the collector is down than while it is up (delivering: ~10 ms for these
    # 80 steps), give or take 50% and 50 ms (the clock ticks every 10 ms); a retry loop
    # that spun would use most of the phase's ~2 s. CPU time, not step times: under two
    # CPU burners and a second test process the median step ratio of one phase against
    # the other varied by 25% (1.26 / 1.01 and 1.28 / 0.99 in two of ten runs).
    assert down_cpu <= 1.5 * up_cpu + 0.05, (down_cpu, up_cpu)
    # The step never waits on the network, and a sender spinning on the GIL (a busy retry
    # loop would double a step of this loop) shows in the step times too.
    ratio, ratio_up = slowdown(down_watched, down_bare), slowdown(up_watched, up_bare)
    assert ratio / max(ratio_up, 1.0) < 1.6, (ratio, ratio_up)  # loose: a loaded 2-core machine
    assert max(down_watched) < 1.0, max(down_watched)
    stored = stored_run(rows, handle.client_run_id)
    assert_exactly_once(stored, STEPS)
    assert sum(stored["dropped"].values()) == 0
    record_figure(
        "sigkill mid-run",
        f"{STEPS} steps, collector (2 workers) SIGKILLed for {third} steps: "
        f"{counters['send_failures']} failed sends, {counters['batches_spooled']} batches "
        f"spooled, step time vs a bare loop {ratio:.2f}x while down, {ratio_up:.2f}x while up "
        f"(outage cost {ratio / ratio_up:.2f}x), sender CPU {down_cpu:.2f} s down, "
        f"{up_cpu:.2f} s up, records lost 0, duplicates 0",
    )


def test_sigkill_during_ingest_keeps_the_database_consistent(
    collector_process: Callable[..., CollectorProcess], rows: RowCounter
) -> None:
    """8 senders stream batches into 2 workers; the whole collector is SIGKILLed while
    requests are in flight. Every stored batch is whole (no half-written batch), every
    acknowledged batch is stored, and resending everything after a restart stores each
    unacknowledged batch once and answers the rest as duplicates."""
    collector = collector_process(workers=2)
    senders, per_sender, steps_per_batch, layers = 8, 25, 50, 32
    bodies = {
        f"kill-{a}": [
            wire_batch(f"kill-{a}", seq, steps_per_batch=steps_per_batch, layers=layers,
                       layer_every=LAYER_STATS_EVERY)[0]
            for seq in range(per_sender)
        ]
        for a in range(senders)
    }  # fmt: skip
    acked: set[tuple[str, int]] = set()
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    started = threading.Event()

    def send(run: str, url: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            for seq, body in enumerate(bodies[run]):
                try:
                    answer = client.post(INGEST_PATH, content=body, headers=headers)
                except httpx.HTTPError:
                    return  # the collector died under us
                started.set()
                if answer.status_code == 200:
                    acked.add((run, seq))

    threads = [threading.Thread(target=send, args=(run, collector.url)) for run in bodies]
    for thread in threads:
        thread.start()
    started.wait(30)
    wait_for(lambda: len(acked) >= senders * 3, what="some batches acknowledged")
    collector.kill()
    for thread in threads:
        thread.join(30)
    assert len(acked) < senders * per_sender, "killed too late: nothing was in flight"

    stored = _stored_batches(rows)
    _assert_every_stored_batch_whole(rows, stored, steps_per_batch, layers)
    assert acked <= stored, sorted(acked - stored)[:5]
    unacked_but_stored = stored - acked

    collector_process(workers=2, port=collector.port)
    answers: list[tuple[int, bool]] = []  # the agents' retry: every batch again, same seq

    def resend(run: str) -> None:
        with httpx.Client(base_url=collector.url, timeout=60) as client:
            for body in bodies[run]:
                answer = client.post(INGEST_PATH, content=body, headers=headers)
                answers.append((answer.status_code, answer.status_code == 200
                                and bool(answer.json()["duplicate"])))  # fmt: skip

    threads = [threading.Thread(target=resend, args=(run,)) for run in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [status for status, _ in answers] == [200] * senders * per_sender
    duplicates = sum(duplicate for _, duplicate in answers)
    final = _stored_batches(rows)
    assert final == {(run, seq) for run in bodies for seq in range(per_sender)}
    assert duplicates == len(stored)
    _assert_every_stored_batch_whole(rows, final, steps_per_batch, layers)
    record_figure(
        "sigkill during ingest",
        f"{senders} senders x {per_sender} batches; killed after {len(acked)} acks: "
        f"{len(stored)} batches stored, all whole, {len(unacked_but_stored)} stored but "
        f"unacknowledged (answered duplicate on retry), {len(final) - len(stored)} retried "
        f"after restart; records lost 0, duplicates 0",
    )


def _stored_batches(rows: RowCounter) -> set[tuple[str, int]]:
    return {
        (run, seq)
        for run, seq in rows.rows(
            select(Run.client_run_id, IngestedBatch.seq).join(Run, Run.id == IngestedBatch.run_id)
        )
    }


def _assert_every_stored_batch_whole(
    rows: RowCounter, stored: set[tuple[str, int]], steps_per_batch: int, layers: int
) -> None:
    """The stored steps and layer rows are exactly those of the stored batches."""
    expected_steps: dict[str, set[int]] = {}
    for run, seq in stored:
        first = seq * steps_per_batch + 1
        expected_steps.setdefault(run, set()).update(range(first, first + steps_per_batch))
    actual_steps: dict[str, set[int]] = {}
    for run, step in rows.rows(select(Run.client_run_id, Step.step).join(Run)):
        actual_steps.setdefault(run, set()).add(step)
    assert actual_steps == expected_steps
    actual_layers: dict[str, int] = dict(rows.rows(
        select(Run.client_run_id, func.count()).select_from(LayerStat).join(Run)
        .group_by(Run.client_run_id)
    ))  # fmt: skip
    expected_layers = {
        run: sum(1 for s in steps if (s - 1) % LAYER_STATS_EVERY == 0) * len(LAYER_STATS)
        for run, steps in expected_steps.items()
    }
    assert actual_layers == expected_layers


def _spool_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


@pytest.mark.parametrize("fault", ["5xx", "slow"])
def test_faulty_collector_bounded_agent_memory_counted_drops(
    fault: str,
    collector_process: Callable[..., CollectorProcess],
    rows: RowCounter,
    spool_root: Path,
) -> None:
    """Behind a proxy answering 503 (or taking 3 s per request): the step never waits,
    the agent's queue, buffer and spool stay inside their bounds, it drops (oldest layer
    statistics first) and counts, and once the collector recovers the server holds
    exactly those counts: stored + dropped = produced, for every kind."""
    spool_max = 8 * 1024
    limits = {"max_queue": 200, "max_buffered": 400, "max_buffered_layer_stats": 20}
    delivery = DeliveryOptions(retry_cap=0.2, spool_after=2, spool_max_bytes=spool_max,
                               max_buffered=limits["max_buffered"],
                               max_buffered_layer_stats=limits["max_buffered_layer_stats"])  # fmt: skip
    collector = collector_process(workers=2)
    with FaultProxy(collector.url) as proxy:
        proxy.latency = 3.0
        trainer, bare = Trainer(), Trainer()
        bare.train(30)
        handle = trainer.watch(url=proxy.url, run=f"faulty-{fault}", layer_stats_every=1,
                               max_queue=limits["max_queue"], delivery=delivery)  # fmt: skip
        sender: Any = handle._sender
        trainer.train(40)
        proxy.mode = "error" if fault == "5xx" else "slow"
        watched: list[float] = []
        plain: list[float] = []
        peaks = {"queue": 0, "buffer": 0, "spool_bytes": 0}
        # At least 180 steps, and (slow) long enough for several slow answers in a row.
        fault_ends = time.monotonic() + (2.5 * proxy.latency if fault == "slow" else 0.0)
        i = 0
        while i < 180 or time.monotonic() < fault_ends:
            i += 1
            watched.append(trainer.step())
            plain.append(bare.step())
            if i % 10 == 0:
                peaks["queue"] = max(peaks["queue"], len(sender._queue))
                peaks["buffer"] = max(peaks["buffer"], len(sender._buffer))
                peaks["spool_bytes"] = max(peaks["spool_bytes"], _spool_bytes(spool_root))
        proxy.mode = "pass"
        trainer.train(20)
        steps = 40 + len(watched) + 20
        handle.detach(timeout=60)
        try:
            wait_for(lambda: _run_ended(rows, handle.client_run_id), timeout=60, what="run end")
        except AssertionError as error:
            # Seen once in a full-suite run, never alone: say what the collector holds.
            raise AssertionError(
                f"{error}: {handle.counters}, proxy {proxy.seen}, stored "
                f"{_stored_events(rows, handle.client_run_id)}"
            ) from None

    counters = handle.counters
    assert counters["hook_errors"] == 0
    assert max(watched) < proxy.latency, max(watched)  # a step never waits for a request
    # Includes the agent's own cost, with layer statistics at every step here (20x the
    # default). Loose: 6 engineers share this 2-core machine; the bound that shows the
    # step never waits is the longest step against the injected latency, above.
    ratio = slowdown(watched, plain)
    assert ratio < 2.5, ratio
    assert peaks["queue"] <= limits["max_queue"]
    assert peaks["buffer"] <= limits["max_buffered"]
    assert peaks["spool_bytes"] <= spool_max + 8192, peaks  # bound + one batch's slack
    dropped = {kind: counters[f"dropped_{kind}"] for kind in ("steps", "layer_stats", "events")}
    if fault == "5xx":
        assert dropped["layer_stats"] > 0, counters  # the outage overflowed the bounds
    stored = stored_run(rows, handle.client_run_id)
    # The server's account is exact: every step is stored or counted as dropped, once.
    assert stored["steps"] + stored["dropped"]["steps"] == steps, stored
    assert stored["layer_steps"] + stored["dropped"]["layer_stats"] == steps, stored
    assert stored["dropped"] == dropped, (stored["dropped"], dropped)  # the agent agrees
    assert stored["distinct_steps"] == stored["steps"]
    for stream, seqs in stored["seqs"].items():
        # batches deleted from a full spool leave gaps (their records are counted above)
        assert seqs == sorted(set(seqs)), (stream, seqs)
        assert sum(dropped.values()) or seqs == list(range(len(seqs))), (stream, seqs)
    record_figure(
        f"collector {fault}",
        f"{steps} steps ({proxy.seen['error'] + proxy.seen['slow']} faulty answers): "
        f"longest step {max(watched) * 1000:.0f} ms, step-time ratio to bare {ratio:.2f}; peak "
        f"queue {peaks['queue']}/{limits['max_queue']}, buffer {peaks['buffer']}/"
        f"{limits['max_buffered']}, spool {peaks['spool_bytes']}/{spool_max} B; dropped "
        f"{dropped} = server's count; unaccounted loss 0",
    )


def test_a_worker_sigkilled_is_replaced_and_the_other_keeps_serving(
    collector_process: Callable[..., CollectorProcess],
) -> None:
    """uvicorn's supervisor replaces a SIGKILLed worker; the port answers throughout."""
    collector = collector_process(workers=2)
    workers = collector.worker_pids()
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    ready = [httpx.get(f"{collector.url}/readyz", timeout=10).status_code for _ in range(10)]
    assert ready == [200] * 10  # the survivor serves while the replacement starts
    wait_for(
        lambda: len(set(collector.worker_pids()) - {workers[0]}) == 2,
        timeout=60,
        what="a replacement worker",
    )
