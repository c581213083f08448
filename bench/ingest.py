"""Collector ingest throughput: 16 simulated agents over real HTTP, SQLite then PostgreSQL.

    python bench/ingest.py            # full: both backends
    python bench/ingest.py --quick    # a few seconds, for the smoke test
    python bench/ingest.py --backend sqlite

Bars (DESIGN.md): >= 1,000,000 layer-statistic values/s (the layer-heavy phase) and
>= 20,000 step records/s (the step-heavy phase) on a 2-core machine, with zero loss, and
(issue 18) with every batch's step rollups (64 steps and the levels up to 65,536) and
layer rollups (every level) written in its transaction, as ingest always does: the bench
prints each phase's verdict, and exits 1 on a missed bar or any loss. The collector runs as `ampwatch serve` would (uvicorn, in
a subprocess, so the agents' client work and the server's share the machine's cores as
they would not in production -- the figures are a lower bound). Agents send what the real
agent sends: gzip JSON batches built with `ampwatch.agent.wire`, bodies built before the
clock starts so the figure is the collector's. Two phases per backend:

- layer-heavy: per batch 200 steps and layer statistics every 10 steps for 500 parameter
  tensors x 4 statistics (40,000 values): the volume that dominates real traffic;
- step-heavy: 2,000 step records per batch (the agent's `max_batch_records`), no layers.

Afterwards every row is counted in the database: any loss fails the run (exit 1).
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
from collector import drop_postgres_database, postgres_database, start_server
from sqlalchemy import func, select

from ampwatch.agent.wire import INGEST_PATH, LAYER_STATS, WIRE_VERSION
from ampwatch.server.db import make_engine
from ampwatch.server.layer_models import LayerStat
from ampwatch.server.migrate import upgrade
from ampwatch.server.models import IngestedBatch
from ampwatch.server.step_models import Step

AGENTS = 16
LAYERS = 500
VALUES_BAR = 1_000_000
STEPS_BAR = 20_000
LAYER_EVERY = 10
#: Each statistic drawn uniformly from [0, scale): a healthy run's magnitudes (a few
#: percent of exact zeros, next to nothing subnormal or flushing, headroom below 65504),
#: so the alert rules evaluate every batch as they would in production without paging.
HEALTHY_SCALE = dict(zip(LAYER_STATS, (0.02, 0.01, 0.001, 512.0)))


@dataclass(frozen=True)
class Phase:
    name: str
    batches_per_agent: int
    steps_per_batch: int
    layer_records_per_batch: int

    def verdict(self, values_per_s: float, steps_per_s: float) -> tuple[str, bool]:
        """The phase's bar, as printed, and whether it was met: layer values/s for a phase
        carrying layer statistics, step records/s for the others."""
        if self.layer_records_per_batch:
            met = values_per_s >= VALUES_BAR
            return f"bar {VALUES_BAR:,} layer values/s: {'ok' if met else 'UNDER'}", met
        met = steps_per_s >= STEPS_BAR
        return f"bar {STEPS_BAR:,} step records/s: {'ok' if met else 'UNDER'}", met


def make_body(run: str, seq: int, phase: Phase, rng: random.Random) -> bytes:
    """One gzip wire batch, as the agent's sender seals it."""
    first = seq * phase.steps_per_batch + 1
    steps = [
        {"step": s, "rank": 0, "skipped": s % 997 == 0, "loss": 2.0 + rng.random(),
         "loss_scale": 65536.0, "grad_norm": rng.random(), "lr": 1e-3,
         "act_norm_mean": 7.5, "act_norm_max": 11.0}
        for s in range(first, first + phase.steps_per_batch)
    ]  # fmt: skip
    names = [f"blocks.{i // 8}.layer{i % 8}.weight" for i in range(LAYERS)]
    layer_stats = [
        {
            "step": first + r * LAYER_EVERY,
            "rank": 0,
            "names": names,
            "stats": {
                stat: [scale * rng.random() for _ in names] for stat, scale in HEALTHY_SCALE.items()
            },
        }
        for r in range(phase.layer_records_per_batch)
    ]
    batch = {
        "wire_version": WIRE_VERSION,
        "run": {"client_run_id": run, "name": run, "project": "default"},
        "stream": "0",
        "seq": seq,
        "steps": steps,
        "layer_stats": layer_stats,
        "events": [],
        "dropped": {"steps": 0, "layer_stats": 0, "events": 0},
    }
    return gzip.compress(orjson.dumps(batch), compresslevel=5)


def run_phase(url: str, phase: Phase, tag: str) -> tuple[float, list[float]]:
    """Send every agent's batches concurrently; returns (seconds, per-request latencies)."""
    bodies = [
        [make_body(f"{tag}-{phase.name}-{a}", seq, phase, random.Random(a * 1000 + seq))
         for seq in range(phase.batches_per_agent)]
        for a in range(AGENTS)
    ]  # fmt: skip
    latencies: list[float] = []
    errors: list[str] = []
    barrier = threading.Barrier(AGENTS + 1)

    def agent(own: list[bytes]) -> None:
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        with httpx.Client(base_url=url, timeout=120) as client:
            barrier.wait()
            for body in own:
                started = time.perf_counter()
                response = client.post(INGEST_PATH, content=body, headers=headers)
                latencies.append(time.perf_counter() - started)
                if response.status_code != 200 or response.json()["duplicate"]:
                    errors.append(f"{response.status_code} {response.text[:200]}")

    threads = [threading.Thread(target=agent, args=(own,)) for own in bodies]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise SystemExit(f"{len(errors)} batches failed, first: {errors[0]}")
    return elapsed, latencies


def count_stored(database_url: str, tag: str) -> tuple[int, int, int]:
    """(batches, step rows, layer values) stored for this run of the bench."""
    from ampwatch.server.models import Run

    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            mine = select(Run.id).where(Run.client_run_id.startswith(tag))
            batches = connection.scalar(select(func.count()).where(IngestedBatch.run_id.in_(mine)))
            steps = connection.scalar(select(func.count()).where(Step.run_id.in_(mine)))
            # Every packed row holds one value per layer of its run: count them exactly.
            values = connection.scalar(
                select(func.sum(func.length(LayerStat.values) / 8)).where(
                    LayerStat.run_id.in_(mine)
                )
            )
    finally:
        engine.dispose()
    return int(batches or 0), int(steps or 0), int(values or 0)


def bench_backend(name: str, database_url: str, phases: list[Phase], workers: int) -> bool:
    upgrade(database_url)
    process, url = start_server(database_url, workers=workers)
    print(f"{name:10} collector: `ampwatch serve` with {workers} worker process(es)")
    tag = uuid.uuid4().hex[:8]
    ok = True
    try:
        for phase in phases:
            elapsed, latencies = run_phase(url, phase, tag)
            batches = AGENTS * phase.batches_per_agent
            steps = batches * phase.steps_per_batch
            values = batches * phase.layer_records_per_batch * LAYERS * len(LAYER_STATS)
            latencies.sort()
            p50 = latencies[len(latencies) // 2]
            p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
            verdict, met = phase.verdict(values / elapsed, steps / elapsed)
            ok &= met
            print(
                f"{name:10} {phase.name:12} {batches:5d} batches in {elapsed:6.2f} s: "
                f"{values / elapsed:>12,.0f} layer values/s  {steps / elapsed:>10,.0f} step "
                f"records/s  (p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms per batch); "
                f"{verdict}"
            )
    finally:
        process.terminate()
        process.wait(timeout=30)
    stored = count_stored(database_url, tag)
    expected = (
        sum(AGENTS * p.batches_per_agent for p in phases),
        sum(AGENTS * p.batches_per_agent * p.steps_per_batch for p in phases),
        sum(AGENTS * p.batches_per_agent * p.layer_records_per_batch * LAYERS * len(LAYER_STATS)
            for p in phases),
    )  # fmt: skip
    verdict = "zero loss" if stored == expected else "LOSS"
    ok &= stored == expected
    print(
        f"{name:10} stored (batches, steps, layer values) = {stored}, "
        f"expected {expected}: {verdict}"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few batches per agent")
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument(
        "--workers", type=int, default=None,
        help="collector worker processes (default: 1 on SQLite, 2 on PostgreSQL, as deployed)",
    )  # fmt: skip
    args = parser.parse_args()
    scale = 1 if args.quick else 6
    phases = [
        Phase("layer-heavy", batches_per_agent=scale, steps_per_batch=200,
              layer_records_per_batch=200 // LAYER_EVERY),
        Phase("step-heavy", batches_per_agent=scale, steps_per_batch=2000,
              layer_records_per_batch=0),
    ]  # fmt: skip
    print(
        f"{AGENTS} agents, {LAYERS} layers x {len(LAYER_STATS)} statistics, "
        f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}); bars: "
        f"{VALUES_BAR:,} values/s, {STEPS_BAR:,} step records/s, rollups written in each "
        "batch's transaction"
    )
    ok = True
    if args.backend in ("sqlite", "both"):
        with tempfile.TemporaryDirectory() as folder:
            sqlite_url = f"sqlite:///{Path(folder) / 'bench.db'}"
            ok &= bench_backend("sqlite", sqlite_url, phases, args.workers or 1)
    if args.backend in ("postgres", "both"):
        database_url = postgres_database()
        if database_url is not None:
            try:
                ok &= bench_backend("postgres", database_url, phases, args.workers or 2)
            finally:
                drop_postgres_database(database_url)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
