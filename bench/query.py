"""Dashboard queries over a long run, over real HTTP, on SQLite then PostgreSQL.

    python bench/query.py            # 100,000 steps x 500 layers, both backends
    python bench/query.py --quick    # 10,000 steps x 100 layers, for the smoke test

Bars (DESIGN.md, issue 4), medians over many calls: one downsampled series <= 50 ms, one
layer's series <= 50 ms, the downsampled layers x steps heatmap <= 300 ms.

The run: 100,000 optimizer steps (every step's scalars, a skipped step every ~1,000) and
layer statistics for 500 parameter tensors every 10 steps -- 10,000 samples x 500 layers
x 4 statistics (20 M values), the agent's sampling at `layer_stats_every=10`, twice as
dense as its default of 20, so the figures are for the heavier case. It is stored through
the collector's own ingest code (in-process, to save minutes); the queries go over HTTP
to `ampwatch serve` in a subprocess, as the dashboard's would.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from collector import drop_postgres_database, postgres_database, start_server

from ampwatch.agent.wire import LAYER_STATS, WIRE_VERSION
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.ingest import ingest_batch
from ampwatch.server.migrate import upgrade
from ampwatch.server.schemas.wire import BatchIn

LAYER_EVERY = 10
STEPS_PER_BATCH = 2000


def populate(database_url: str, steps: int, layers: int) -> None:
    """Store one run of `steps` steps and `layers` layers through the ingest code."""
    upgrade(database_url)
    engine = make_engine(database_url)
    sessions = make_sessionmaker(engine)
    rng = np.random.default_rng(0)
    names = [f"blocks.{i // 8}.layer{i % 8}.weight" for i in range(layers)]
    try:
        for seq, first in enumerate(range(1, steps + 1, STEPS_PER_BATCH)):
            last = min(first + STEPS_PER_BATCH, steps + 1)
            losses = (2.0 + rng.random(last - first)).tolist()
            batch = {
                "wire_version": WIRE_VERSION,
                "run": {"client_run_id": "bench", "name": "bench", "project": "default"},
                "stream": "0",
                "seq": seq,
                "steps": [
                    {"step": s, "rank": 0, "skipped": s % 1009 == 0, "loss": loss,
                     "loss_scale": 65536.0, "grad_norm": loss, "lr": 1e-3,
                     "act_norm_mean": 7.0, "act_norm_max": 11.0}
                    for s, loss in zip(range(first, last), losses)
                ],
                "layer_stats": [
                    {"step": s, "rank": 0, "names": names,
                     "stats": {stat: rng.random(layers).tolist() for stat in LAYER_STATS}}
                    for s in range(first, last, LAYER_EVERY)
                ],
            }  # fmt: skip
            with sessions() as session:
                ingest_batch(session, BatchIn.model_validate(batch))
    finally:
        engine.dispose()


def timed(client: httpx.Client, path: str, calls: int, **params: object) -> tuple[float, int]:
    """Median seconds of `calls` GETs of `path`, and the answer's size in bytes."""
    durations = []
    size = 0
    for _ in range(calls):
        started = time.perf_counter()
        response = client.get(path, params=params)
        durations.append(time.perf_counter() - started)
        response.raise_for_status()
        size = len(response.content)
    return statistics.median(durations), size


def bench_backend(name: str, database_url: str, steps: int, layers: int, calls: int) -> bool:
    started = time.perf_counter()
    populate(database_url, steps, layers)
    print(
        f"{name:9} stored {steps:,} steps x {layers} layers in "
        f"{time.perf_counter() - started:.0f} s"
    )
    process, url = start_server(database_url)
    layer = f"blocks.{(layers // 2) // 8}.layer{(layers // 2) % 8}.weight"
    queries = [
        ("downsampled steps (all fields)", "/steps", {}, 0.050),
        (
            "downsampled series, zoom 10%",
            "/steps",
            {"start": steps // 2, "end": steps // 2 + steps // 10},
            0.050,
        ),
        ("one layer's series", f"/layers/{layer}/series", {"stat": "zero_fraction"}, 0.050),
        ("layers x steps heatmap", "/layers", {"stat": "zero_fraction"}, 0.300),
    ]
    ok = True
    try:
        with httpx.Client(base_url=f"{url}/api/v1/runs/1", timeout=60) as client:
            for label, path, params, bar in queries:
                timed(client, path, 2, **params)  # warm caches and the connection
                median, size = timed(client, path, calls, **params)
                verdict = "ok" if median <= bar else "OVER"
                ok &= median <= bar
                print(
                    f"{name:9} {label:32} median {median * 1000:7.1f} ms "
                    f"(bar {bar * 1000:.0f} ms, {verdict})  {size / 1024:8.1f} KiB"
                )
    finally:
        process.terminate()
        process.wait(timeout=30)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10,000 steps x 100 layers")
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--calls", type=int, default=30, help="calls per query (median)")
    args = parser.parse_args()
    steps, layers = (10_000, 100) if args.quick else (100_000, 500)
    calls = 5 if args.quick else args.calls
    ok = True
    if args.backend in ("sqlite", "both"):
        with tempfile.TemporaryDirectory() as folder:
            url = f"sqlite:///{Path(folder) / 'bench.db'}"
            ok &= bench_backend("sqlite", url, steps, layers, calls)
    if args.backend in ("postgres", "both"):
        database_url = postgres_database()
        if database_url is not None:
            try:
                ok &= bench_backend("postgres", database_url, steps, layers, calls)
            finally:
                drop_postgres_database(database_url)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
