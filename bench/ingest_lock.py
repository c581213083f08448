"""How long one batch at the ingest limits makes another tenant wait, on SQLite.

    python bench/ingest_lock.py                  # one batch at every limit at once
    python bench/ingest_lock.py --names 65536 --values 1800000 --records 50000

SQLite has one writer: a batch is one transaction, and holds the write lock for as long as
it takes to store, and to judge, its records. One `ampwatch serve` over a fresh SQLite
file (its body limit raised to 512 MiB, so that the record limits bind); tenant A posts
one valid batch at the limits (`schemas.wire.MAX_BATCH_*`, every new
layer name, each name in every layer record, the other records steps), while tenant B,
another run, posts a 10-step batch every 0.2 s until A is answered. Prints A's time and
B's worst wait; exits 1 when B waited 2 s or more (issue 26's bar: at the old limits of
65,536 names, 2 M values and 50,000 records a batch held the lock 41-48 s, and B's ingest
answered 503 after the 30 s busy timeout).
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
from pathlib import Path

import httpx
import orjson
from collector import start_server

from ampwatch.agent.wire import INGEST_PATH, WIRE_VERSION
from ampwatch.server.migrate import upgrade
from ampwatch.server.schemas.wire import (
    MAX_BATCH_LAYER_NAMES,
    MAX_BATCH_LAYER_VALUES,
    MAX_BATCH_RECORDS,
)

BAR_S = 2.0
HEADERS = {"Content-Type": "application/json", "Content-Encoding": "gzip"}


def batch(run: str, *, names: int, values: int, records: int, first: int = 1) -> bytes:
    """A valid gzip batch: `values` // `names` layer records naming all `names` layers
    (zero fractions of a healthy run), the rest of `records` step records."""
    rng = random.Random(run)
    layer = [f"blocks.{i // 8}.layer{i % 8}.weight" for i in range(names)]
    samples = values // names if names else 0
    steps = [{"step": s, "rank": 0, "skipped": False, "loss": 2.0 + rng.random(),
              "loss_scale": 65536.0, "grad_norm": 1.0 + rng.random(), "lr": 1e-3,
              "act_norm_mean": 7.5 + rng.random(), "act_norm_max": 11.0}
             for s in range(first, first + records - samples)]  # fmt: skip
    layer_stats = [{"step": first + 10 * r, "rank": 0, "names": layer,
                    "stats": {"zero_fraction": [0.02 * rng.random() for _ in layer]}}
                   for r in range(samples)]  # fmt: skip
    body = {"wire_version": WIRE_VERSION, "run": {"client_run_id": run, "name": run},
            "stream": "0", "seq": first, "steps": steps, "layer_stats": layer_stats,
            "events": [], "dropped": {"steps": 0, "layer_stats": 0, "events": 0}}  # fmt: skip
    return gzip.compress(orjson.dumps(body), compresslevel=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--names", type=int, default=MAX_BATCH_LAYER_NAMES)
    parser.add_argument("--values", type=int, default=MAX_BATCH_LAYER_VALUES)
    parser.add_argument("--records", type=int, default=MAX_BATCH_RECORDS)
    args = parser.parse_args()
    big = batch("tenant-a", names=args.names, values=args.values, records=args.records)
    # The record limits bind, not the body's (a deployment may raise it to them).
    os.environ["AMPWATCH_MAX_BODY_BYTES"] = str(512 * 2**20)
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{Path(folder) / 'lock.db'}"
        upgrade(url)
        process, base = start_server(url)
        try:
            # Warm, as a running collector is: run B exists, the statements of steps and
            # layer rows are compiled (~0.5 s of the first layer batch's lock, once).
            with httpx.Client(base_url=base, timeout=300) as client:
                client.post(INGEST_PATH, content=batch("tenant-b", names=1, values=1,
                                                       records=10), headers=HEADERS)  # fmt: skip
            answered = threading.Event()
            outcome: dict[str, float | int] = {}

            def tenant_a() -> None:
                started = time.perf_counter()
                with httpx.Client(base_url=base, timeout=600) as client:
                    outcome["a_status"] = client.post(INGEST_PATH, content=big,
                                                      headers=HEADERS).status_code  # fmt: skip
                outcome["a_s"] = time.perf_counter() - started
                answered.set()

            waits: list[float] = []
            statuses: list[int] = []
            thread = threading.Thread(target=tenant_a)
            thread.start()
            with httpx.Client(base_url=base, timeout=600) as client:
                seq = 1
                while not answered.is_set():
                    body = batch("tenant-b", names=0, values=0, records=10, first=10 * seq + 1)
                    started = time.perf_counter()
                    statuses.append(client.post(INGEST_PATH, content=body,
                                                headers=HEADERS).status_code)  # fmt: skip
                    waits.append(time.perf_counter() - started)
                    seq += 1
                    answered.wait(0.2)
            thread.join()
        finally:
            process.terminate()
            process.wait(timeout=30)
    worst = max(waits, default=0.0)
    ok = outcome.get("a_status") == 200 and set(statuses) <= {200} and worst < BAR_S
    print(f"tenant A: {args.names:,} new names, {args.values // max(args.names, 1) * args.names:,} "
          f"values, {args.records:,} records: {outcome.get('a_status')} in "
          f"{outcome.get('a_s', 0):.2f} s; tenant B: {len(waits)} batches meanwhile "
          f"(answers {sorted(set(statuses))}), worst wait {worst:.2f} s "
          f"(bar < {BAR_S:.0f} s: {'ok' if ok else 'OVER'})")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
