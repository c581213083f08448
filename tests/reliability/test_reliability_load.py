"""Load: 64 concurrent agents for a bounded time against two collector workers on
PostgreSQL. Reports the values/s held and the p99 ingest latency; every acknowledged
record is counted in the database afterwards (zero loss, zero duplicates).

The agents are simulated (threads sending the agent's gzip wire batches, retrying like
its sender: same seq, by `ampwatch.agent.retry.is_retryable`), in the test's own
process: on the 2-core machine they take CPU from the collector, so the figures are a
lower bound. `bench/soak.py --load-seconds N` is the long version.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from reliability_procs import CollectorProcess, RowCounter, record_figure
from reliability_support import LAYER_STATS_EVERY, p99, wire_batch
from sqlalchemy import func, select

from ampwatch.agent.retry import is_retryable
from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server.layer_models import LayerStat
from ampwatch.server.models import IngestedBatch
from ampwatch.server.step_models import Step

pytestmark = pytest.mark.postgres

AGENTS = 64
SECONDS = float(os.environ.get("AMPWATCH_LOAD_SECONDS", "10"))
STEPS_PER_BATCH = 50
LAYERS = 100


class LoadResult:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.batches = self.steps = self.values = self.retries = self.duplicates = 0
        self.errors: list[str] = []


def run_agents(url: str, agents: int, seconds: float, tag: str) -> tuple[LoadResult, float]:
    """`agents` threads, each its own run, sending batch after batch for `seconds`; each
    batch is retried until acknowledged (give up after 120 s: counted as an error)."""
    result = LoadResult()
    barrier = threading.Barrier(agents + 1)
    stop_at = [0.0]
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}

    def agent(index: int) -> None:
        run = f"{tag}-{index}"
        with httpx.Client(base_url=url, timeout=60) as client:
            barrier.wait()
            seq = 0
            while time.monotonic() < stop_at[0]:
                body, steps, values = wire_batch(
                    run, seq, steps_per_batch=STEPS_PER_BATCH, layers=LAYERS,
                    layer_every=LAYER_STATS_EVERY,
                )  # fmt: skip
                give_up = time.monotonic() + 120
                while True:
                    started = time.perf_counter()
                    try:
                        answer = client.post(INGEST_PATH, content=body, headers=headers)
                        status: int | None = answer.status_code
                    except httpx.HTTPError as error:
                        status, answer = None, None
                        last = repr(error)
                    elapsed = time.perf_counter() - started
                    if status == 200 and answer is not None:
                        with result.lock:
                            result.latencies.append(elapsed)
                            result.batches += 1
                            result.steps += steps
                            result.values += values
                            result.duplicates += bool(answer.json()["duplicate"])
                        break
                    with result.lock:
                        result.retries += 1
                    if not is_retryable(status) or time.monotonic() > give_up:
                        with result.lock:
                            text = answer.text[:200] if answer is not None else last
                            result.errors.append(f"{run} seq {seq}: {status} {text}")
                        return
                    time.sleep(0.2)
                seq += 1

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(agents)]
    for thread in threads:
        thread.start()
    stop_at[0] = time.monotonic() + seconds
    barrier.wait()
    started = time.monotonic()
    for thread in threads:
        thread.join(300)
    return result, time.monotonic() - started


def test_64_agents_against_two_workers_on_postgres_lose_nothing(
    collector_process: Callable[..., CollectorProcess], rows: RowCounter
) -> None:
    collector = collector_process(workers=2)
    result, elapsed = run_agents(collector.url, AGENTS, SECONDS, "load")
    assert not result.errors, result.errors[:5]
    assert result.duplicates == 0  # every seq was new: a duplicate would mean a lost ack

    stored_batches = rows.scalar(select(func.count()).select_from(IngestedBatch))
    stored_steps = rows.scalar(select(func.count()).select_from(Step))
    stored_values = rows.scalar(select(func.sum(func.length(LayerStat.values) / 8)))
    assert (stored_batches, stored_steps, int(stored_values or 0)) == (
        result.batches, result.steps, result.values
    ), "records lost or duplicated"  # fmt: skip
    assert result.batches >= AGENTS  # every agent got through at least once

    latency_p99 = p99(result.latencies)
    latency_p50 = sorted(result.latencies)[len(result.latencies) // 2]
    record_figure(
        "load",
        f"{AGENTS} agents x {SECONDS:.0f} s (ran {elapsed:.1f} s incl. drain) on 2 workers + "
        f"PostgreSQL, {os.cpu_count()} CPUs shared with the agents (and other users): "
        f"{result.values / elapsed:,.0f} layer values/s, {result.steps / elapsed:,.0f} "
        f"steps/s, {result.batches} batches, p50 {latency_p50 * 1000:.0f} ms, p99 "
        f"{latency_p99 * 1000:.0f} ms per batch, {result.retries} retries; stored = acked "
        f"({stored_batches} batches, {stored_steps} steps, {int(stored_values or 0)} "
        f"values): records lost 0",
    )
