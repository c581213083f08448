"""What one read costs the collector: CPU seconds of the serving process per request, by
route, for the reads `bench/load.py`'s viewers make, on SQLite then PostgreSQL.

    python bench/read_cost.py           # both backends, 30 calls a route a round, 10 rounds
    python bench/read_cost.py --quick   # SQLite, 5 calls a route a round

Why: under `bench/load.py`'s 1,000 viewers the reads' process is CPU-bound, so its
throughput is about 1 / (CPU per read): this isolates each route's share. The runs are
`bench/load.py`'s (its batches, 64 layers, a NaN loss every 4th batch; the layer statistics
fire per-layer alerts), stored through a real collector (`ampwatch serve` in a subprocess,
one worker); requests go one at a time over one keep-alive connection with a project token,
as a viewer's would, without `If-None-Match` (a 304 would cost less). Rounds interleave the
routes in a shuffled order; printed per route: the median over rounds of the serving
process's CPU time (user + system, from /proc) per request, its wall time, and the answer's
bytes, with `/healthz` as the floor of any request. Linux only (/proc).

Measured (SQLite, one run, a loaded 2-core machine): `/runs/{id}/alerts` 7.2 -> 1.7 ms once
tagged by the run's change counter and kept (`api.conditional`); `/alerts` (a page of 100)
~6-8 ms, the runs list ~3.5-4.7 ms, a kept run answer ~1.1-1.7 ms, `/healthz` 0.23 ms.
With the alert lists tagged by their project's alerts counter (which moves only when an
alert is written, as nothing is here while the routes are measured), back to back on one
day: `/alerts` 7.20 -> 2.87 ms, the other routes unchanged (runs list 3.6 / 3.3 ms, kept
run answers 1.5-1.8 ms, `/healthz` 0.30 ms). With that tag read in the caller's hop and
checked before the page's session opens (`deps.reads_with_caller`), two runs of each
alternated: `/alerts` 3.05 / 3.15 -> 1.45 / 1.45 ms, as a kept run answer (1.45-1.70 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reliability"))  # wire_batch, as bench/load.py

import httpx
from collector import (
    drop_postgres_database,
    postgres_database,
    process_cpu_seconds,
    start_server,
)
from raw_http import Connection

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server import auth
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.migrate import upgrade

RUNS = 8
BATCHES = 8
NAN_EVERY = 4  # as bench/load.py
STEPS_PER_BATCH = 50
LAYERS = 64
ROUNDS = 10


def seed(url: str, token: str) -> list[int]:
    """`RUNS` runs of `BATCHES` of `bench/load.py`'s batches each; their ids."""
    from reliability_support import wire_batch

    headers = {"Authorization": f"Bearer {token}", "Content-Encoding": "gzip"}
    run_ids = []
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for run in range(RUNS):
            for seq in range(BATCHES):
                nan = seq * STEPS_PER_BATCH + 7 if seq % NAN_EVERY == 0 else None
                body, _, _ = wire_batch(
                    f"read-cost-{run}", seq, steps_per_batch=STEPS_PER_BATCH, layers=LAYERS,
                    layer_every=10, project="bench", nan_step=nan,
                )  # fmt: skip
                answer = client.post(INGEST_PATH, content=body)
                answer.raise_for_status()
            run_ids.append(int(answer.json()["run_id"]))
    return run_ids


def project_token(database_url: str) -> str:
    """A project token for `bench`, written into the migrated database (as bench/load.py)."""
    engine = make_engine(database_url)
    with make_sessionmaker(engine)() as session:
        token = auth.create_token(session, project="bench").token
    engine.dispose()
    return token


async def measure(url: str, pid: int, token: str, run_ids: list[int], calls: int) -> None:
    run = f"/api/v1/runs/{run_ids[0]}"
    paths = ["/api/v1/runs", "/api/v1/alerts", f"{run}/alerts", run, f"{run}/steps",
             f"{run}/layers?stat=zero_fraction", f"{run}/events", "/healthz"]  # fmt: skip
    connection = Connection(url, {"Authorization": f"Bearer {token}"}, 60)
    sizes = {}
    for path in paths:  # warm: the kept answers, the statement caches
        status, _, body = await connection.request("GET", path)
        assert status == 200, (path, status)
        sizes[path] = len(body)
    cpu: dict[str, list[float]] = {path: [] for path in paths}
    wall: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(ROUNDS):
        for path in random.sample(paths, len(paths)):
            started_cpu, started = process_cpu_seconds(pid), time.perf_counter()
            for _ in range(calls):
                await connection.request("GET", path)
            wall[path].append((time.perf_counter() - started) / calls)
            cpu[path].append((process_cpu_seconds(pid) - started_cpu) / calls)
    await connection.close()
    for path in paths:
        each = sum(cpu[path]) / ROUNDS  # /proc counts 10 ms ticks: summed, not a median
        print(f"  {path:44s} cpu {1e3 * each:6.2f} ms  "
              f"wall {1e3 * statistics.median(wall[path]):6.2f} ms  {sizes[path]:7d} B",
              flush=True)  # fmt: skip


def run_backend(name: str, database_url: str, calls: int) -> None:
    upgrade(database_url)
    token = project_token(database_url)
    process, url = start_server(database_url)
    try:
        run_ids = seed(url, token)
        print(f"{name}: {RUNS} runs x {BATCHES} batches, {calls} calls a route x {ROUNDS} "
              "rounds: the serving process's CPU and the wall time per request",
              flush=True)  # fmt: skip
        asyncio.run(measure(url, process.pid, token, run_ids, calls))
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--calls", type=int, default=30, help="requests a route per round")
    parser.add_argument("--quick", action="store_true", help="SQLite, 5 calls a route a round")
    args = parser.parse_args()
    calls = 5 if args.quick else args.calls
    backends = ["sqlite"] if args.quick else (
        ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    )  # fmt: skip
    for backend in backends:
        if backend == "sqlite":
            with tempfile.TemporaryDirectory() as folder:
                run_backend("sqlite", f"sqlite:///{folder}/read-cost.db", calls)
            continue
        database_url = postgres_database()
        if database_url is None:
            continue
        try:
            run_backend("postgres", database_url, calls)
        finally:
            drop_postgres_database(database_url)


if __name__ == "__main__":
    main()
