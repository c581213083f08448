"""Dashboard queries over a long run, over real HTTP, on SQLite then PostgreSQL.

    python bench/query.py            # 100,000 steps x 500 layers, both backends
    python bench/query.py --quick    # 10,000 steps x 100 layers, for the smoke test
    python bench/query.py --steps 100000 500000 2000000 --layers 1000 --db-cache /tmp/awq
        # the curve: each query at each length, and the longest / shortest ratio; the
        # populated databases are kept in the cache (SQLite files, PostgreSQL databases
        # named after the size) and reused by later runs; --drop-cache deletes them

Also printed per run: bytes on disk per layer value (raw `layer_stats`, and with the
`layer_rollups`) and per step (the whole database), from SQLite's `dbstat` and
PostgreSQL's `pg_total_relation_size`.

Bars (DESIGN.md, issue 4), medians over many calls: one downsampled series <= 50 ms, one
layer's series <= 50 ms, the downsampled layers x steps heatmap <= 300 ms.

The run: 100,000 optimizer steps (every step's scalars, a skipped step every ~1,000) and
layer statistics for 500 parameter tensors every 10 steps -- 10,000 samples x 500 layers
x 4 statistics (20 M values), the agent's sampling at `layer_stats_every=10`, twice as
dense as its default of 20, so the figures are for the heavier case. It is stored through
the collector's own ingest code (in-process, to save minutes); the queries go over HTTP
to `ampwatch serve` in a subprocess, as the dashboard's would. The alert rules do not run
while populating (they would be three quarters of its time at 1,000 layers).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from collector import POSTGRES_ADMIN_URL, drop_postgres_database, postgres_database, start_server
from sqlalchemy import select, text

from ampwatch.agent.wire import LAYER_STATS, WIRE_VERSION
from ampwatch.server.db import begin_write, make_engine, make_sessionmaker, upsert
from ampwatch.server.ingest import ingest_batch
from ampwatch.server.layer_ingest import LAYER_STAT_COLUMNS, LAYER_STAT_KEY
from ampwatch.server.layer_models import LayerRollup, LayerStat
from ampwatch.server.layer_rollups import (
    LAYER_LEVELS,
    ROLLUP_COLUMNS,
    ROLLUP_KEY,
    rollups_from_rows,
)
from ampwatch.server.migrate import upgrade
from ampwatch.server.schemas.wire import MAX_BATCH_LAYER_VALUES, BatchIn

LAYER_EVERY = 10
STEPS_PER_BATCH = 2000


#: Runs longer than this are populated in bulk (`populate`'s `bulk`).
BULK_ABOVE = 100_000


def populate(database_url: str, steps: int, layers: int, *, bulk: bool = False) -> None:
    """Store one run of `steps` steps and `layers` layers through the ingest code.

    `bulk`: the step records and the first batch's layer records go through
    `ingest_batch`; every later packed layer row is upserted as ingest does (`db.upsert`),
    without parsing a wire batch, and the layer rollups are then computed by
    `rollups_from_rows` (the same reduction as ingest's). At
    2M x 1,000 (800 M values) the full path would take about an hour on this machine.
    """
    upgrade(database_url)
    engine = make_engine(database_url)
    sessions = make_sessionmaker(engine)
    rng = np.random.default_rng(0)
    names = [f"blocks.{i // 8}.layer{i % 8}.weight" for i in range(layers)]
    # A wire batch holds at most MAX_BATCH_LAYER_VALUES: a step batch's layer samples go
    # in as many batches as they need (2,000 steps x 1,000 layers is 800,000 values).
    per_batch = max(1, MAX_BATCH_LAYER_VALUES // (layers * len(LAYER_STATS)))
    seq = 0
    try:
        for first in range(1, steps + 1, STEPS_PER_BATCH):
            last = min(first + STEPS_PER_BATCH, steps + 1)
            losses = (2.0 + rng.random(last - first)).tolist()
            sampled = range(first, last, LAYER_EVERY)
            step_records = [
                {"step": s, "rank": 0, "skipped": s % 1009 == 0, "loss": loss,
                 "loss_scale": 65536.0, "grad_norm": loss, "lr": 1e-3,
                 "act_norm_mean": 7.0, "act_norm_max": 11.0}
                for s, loss in zip(range(first, last), losses)
            ]  # fmt: skip
            parsed = [] if bulk and seq else list(sampled)
            chunks = [parsed[i : i + per_batch] for i in range(0, len(parsed), per_batch)]
            for k, chunk in enumerate(chunks or [[]]):
                batch = {
                    "wire_version": WIRE_VERSION,
                    "run": {"client_run_id": "bench", "name": "bench", "project": "default"},
                    "stream": "0",
                    "seq": seq,
                    "steps": [] if k else step_records,
                    "layer_stats": [
                        {"step": s, "rank": 0, "names": names,
                         "stats": {stat: rng.random(layers).tolist() for stat in LAYER_STATS}}
                        for s in chunk
                    ],
                }  # fmt: skip
                seq += 1
                with sessions() as session:
                    ack = ingest_batch(
                        session, BatchIn.model_validate(batch), evaluate_alerts=False
                    )
            if bulk and not parsed:
                rows = [
                    (ack.run_id, 0, stat, s, rng.random(layers).astype("<f8").tobytes())
                    for s in sampled
                    for stat in LAYER_STATS
                ]
                with sessions() as session:
                    begin_write(session)
                    upsert(session, LayerStat, LAYER_STAT_COLUMNS, rows, LAYER_STAT_KEY)
                    session.commit()
        if bulk:
            _bulk_rollups(sessions)
    finally:
        engine.dispose()


def _bulk_rollups(sessions: Any) -> None:
    """Every layer rollup of the bench run from its raw rows, a statistic at a time."""
    for stat in LAYER_STATS:
        with sessions() as session:
            rows = session.execute(
                select(LayerStat.step, LayerStat.values)
                .where(LayerStat.run_id == 1, LayerStat.rank == 0, LayerStat.stat == stat)
                .order_by(LayerStat.step)
                .execution_options(yield_per=10_000)
            )
            rollups = rollups_from_rows(1, 0, stat, ((r[0], r[1]) for r in rows))
        with sessions() as session:
            begin_write(session)
            for i in range(0, len(rollups), 2_000):
                upsert(session, LayerRollup, ROLLUP_COLUMNS, rollups[i : i + 2_000], ROLLUP_KEY)
            session.commit()


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


#: (label, path under /api/v1, parameters, bar in s, whole-run: its cost must not grow).
def query_list(steps: int, layers: int) -> list[tuple[str, str, dict[str, object], float, bool]]:
    layer = f"blocks.{(layers // 2) // 8}.layer{(layers // 2) % 8}.weight"
    middle = {"start": steps // 2, "end": steps // 2 + steps // 10}
    return [
        ("downsampled steps (all fields)", "/runs/1/steps", {}, 0.050, True),
        ("downsampled series, zoom 10%", "/runs/1/steps", middle, 0.050, False),
        ("one layer's series", f"/runs/1/layers/{layer}/series", {"stat": "zero_fraction"},
         0.050, True),
        ("layers x steps heatmap", "/runs/1/layers", {"stat": "zero_fraction"}, 0.300, True),
        ("heatmap zoom 2,000 steps (raw rows)", "/runs/1/layers",
         {"stat": "zero_fraction", "start": steps // 2, "end": steps // 2 + 1999}, 0.300, False),
        ("runs list", "/runs", {}, 0.050, True),
    ]  # fmt: skip


def storage(database_url: str) -> dict[str, int]:
    """Bytes on disk of `layer_stats`, `layer_rollups` and the whole database (indexes
    included; SQLite's primary-key tables are their own index)."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            if engine.dialect.name == "sqlite":
                rows = connection.execute(
                    text("SELECT name, sum(pgsize) FROM dbstat GROUP BY name")
                ).all()
                sizes = {str(name): int(size) for name, size in rows}
                layer = sum(v for k, v in sizes.items() if "layer_stats" in k)
                rollups = sum(v for k, v in sizes.items() if "layer_rollups" in k)
                return {
                    "layer_stats": layer,
                    "layer_rollups": rollups,
                    "total": sum(sizes.values()),
                }
            size = "SELECT pg_total_relation_size(:t)"
            return {
                "layer_stats": int(connection.scalar(text(size), {"t": "layer_stats"})),
                "layer_rollups": int(connection.scalar(text(size), {"t": "layer_rollups"})),
                "total": int(
                    connection.scalar(text("SELECT pg_database_size(current_database())"))
                ),
            }
    finally:
        engine.dispose()


def _postgres_url(name: str) -> str:
    from sqlalchemy.engine import make_url

    url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg", database=name)
    return url.render_as_string(hide_password=False)


@contextmanager
def database(backend: str, steps: int, layers: int, cache: Path | None) -> Iterator[str | None]:
    """The URL of a populated bench database (None: PostgreSQL unreachable). With `cache`,
    kept and reused: an SQLite file there, or a PostgreSQL database named after the size,
    each marked complete by a file in `cache` once populated."""
    tag = f"ampwatch_bench_q{steps}x{layers}"
    if cache is None:
        with tempfile.TemporaryDirectory() as folder:
            if backend == "sqlite":
                url: str | None = f"sqlite:///{Path(folder) / 'bench.db'}"
            else:
                url = postgres_database()
            if url is not None:
                try:
                    _populate_timed(backend, url, steps, layers)
                    yield url
                finally:
                    if backend == "postgres":
                        drop_postgres_database(url)
            else:
                yield None
        return
    cache.mkdir(parents=True, exist_ok=True)
    done = cache / f"{tag}.{backend}.done"
    url = f"sqlite:///{cache / f'{tag}.db'}" if backend == "sqlite" else _postgres_url(tag)
    if not done.exists():
        if backend == "sqlite":
            (cache / f"{tag}.db").unlink(missing_ok=True)
        else:
            _recreate_postgres(tag)
        _populate_timed(backend, url, steps, layers)
        if backend == "postgres":
            _vacuum(url)
        done.touch()
    else:
        upgrade(url)  # a cache built before a newer migration
        print(f"{backend:9} reusing {steps:,} steps x {layers} layers from {cache}")
    yield url


def _recreate_postgres(name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def _vacuum(database_url: str) -> None:
    """VACUUM ANALYZE, as autovacuum would have done by the time a real run is this long:
    straight after a bulk load PostgreSQL's planner has no statistics and its index-only
    scans no visibility map."""
    engine = make_engine(database_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text("VACUUM ANALYZE"))
    finally:
        engine.dispose()


def drop_cache(cache: Path) -> None:
    """Delete the cached databases: the folder and the PostgreSQL databases it marks."""
    for done in cache.glob("*.postgres.done"):
        drop_postgres_database(_postgres_url(done.name.split(".")[0]))
    shutil.rmtree(cache, ignore_errors=True)


def _populate_timed(backend: str, url: str, steps: int, layers: int) -> None:
    started = time.perf_counter()
    bulk = steps > BULK_ABOVE
    populate(url, steps, layers, bulk=bulk)
    print(
        f"{backend:9} stored {steps:,} steps x {layers} layers in "
        f"{time.perf_counter() - started:.0f} s{' (bulk)' if bulk else ''}",
        flush=True,
    )


def bench_backend(
    name: str, database_url: str, steps: int, layers: int, calls: int
) -> tuple[bool, dict[str, float]]:
    """Every query's median over HTTP (and whether each met its bar), plus storage."""
    sizes = storage(database_url)
    samples = steps // LAYER_EVERY * layers * len(LAYER_STATS)
    print(
        f"{name:9} {steps:,} x {layers}: layer_stats {sizes['layer_stats'] / 2**20:,.0f} MiB "
        f"({sizes['layer_stats'] / samples:.2f} B per layer value), layer_rollups "
        f"{sizes['layer_rollups'] / 2**20:,.0f} MiB (+{sizes['layer_rollups'] / samples:.2f} B; "
        f"{len(LAYER_LEVELS)} levels), database {sizes['total'] / 2**20:,.0f} MiB "
        f"({sizes['total'] / steps:,.0f} B per step)"
    )
    process, url = start_server(database_url)
    ok = True
    medians: dict[str, float] = {}
    try:
        with httpx.Client(base_url=f"{url}/api/v1", timeout=60) as client:
            for label, path, params, bar, _ in query_list(steps, layers):
                timed(client, path, 2, **params)  # warm caches and the connection
                median, size = timed(client, path, calls, **params)
                medians[label] = median
                verdict = "ok" if median <= bar else "OVER"
                ok &= median <= bar
                print(
                    f"{name:9} {label:36} median {median * 1000:7.1f} ms "
                    f"(bar {bar * 1000:.0f} ms, {verdict})  {size / 1024:8.1f} KiB"
                )
    finally:
        process.terminate()
        process.wait(timeout=30)
    return ok, medians


def print_curve(
    name: str, lengths: list[int], layers: int, curve: dict[int, dict[str, float]]
) -> bool:
    """The table of medians by run length and the longest / shortest ratio (goal <= 1.5
    for the whole-run queries); returns whether every whole-run ratio met it."""
    first, last = lengths[0], lengths[-1]
    print(f"\n{name}, {layers} layers: median ms by run length")
    header = " | ".join(f"{n:>9,}" for n in lengths)
    print(f"| {'query':36} | {header} | {last // 1000}k/{first // 1000}k |")
    ok = True
    for label, _, _, _, whole in query_list(first, layers):
        cells = " | ".join(f"{curve[n][label] * 1000:9.1f}" for n in lengths)
        ratio = curve[last][label] / curve[first][label]
        flag = "" if not whole else (" ok" if ratio <= 1.5 else " OVER")
        ok &= not whole or ratio <= 1.5
        print(f"| {label:36} | {cells} | {ratio:5.2f}{flag} |")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10,000 steps x 100 layers")
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--calls", type=int, default=30, help="calls per query (median)")
    parser.add_argument("--steps", type=int, nargs="+", help="run lengths (default 100,000)")
    parser.add_argument("--layers", type=int, help="parameter tensors (default 500)")
    parser.add_argument("--db-cache", type=Path, help="keep and reuse the populated databases")
    parser.add_argument("--drop-cache", action="store_true", help="delete --db-cache and exit")
    args = parser.parse_args()
    if args.drop_cache:
        if args.db_cache is None:
            parser.error("--drop-cache needs --db-cache")
        drop_cache(args.db_cache)
        return 0
    lengths, layers = ([10_000], 100) if args.quick else ([100_000], 500)
    lengths, layers = sorted(args.steps or lengths), args.layers or layers
    calls = 5 if args.quick else args.calls
    ok = True
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    for backend in backends:
        curve: dict[int, dict[str, float]] = {}
        for steps in lengths:
            with database(backend, steps, layers, args.db_cache) as url:
                if url is None:
                    break
                met, curve[steps] = bench_backend(backend, url, steps, layers, calls)
                ok &= met
        if len(curve) > 1:
            ok &= print_curve(backend, sorted(curve), layers, curve)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
