"""Soak: the long versions of tests/reliability, against two collector workers on PostgreSQL.

    python bench/soak.py                      # 5 min of load, 10 whole-collector kills
    python bench/soak.py --quick              # ~1 min, for a smoke run
    python bench/soak.py --load-seconds 600 --agents 64 --kills 30

Three phases, each ending in an exact count of what the database holds:

1. load: N simulated agents (threads sending the agent's gzip wire batches, retrying
   like its sender: same seq, by `ampwatch.agent.retry.is_retryable`) for the given
   time; values/s and steps/s held, p50/p99 ingest latency, records lost.
2. worker kills: the same load while one uvicorn worker at a time is SIGKILLed every few
   seconds (the supervisor replaces it); records lost.
3. collector kills: a real FP16 training loop with the agent, while the whole collector
   (supervisor and workers) is SIGKILLed and restarted again and again; step-time ratio
   against the same loop without the agent, records lost or duplicated.

The agents run in this process: on a 2-core machine they take CPU from the collector, so
the figures are a lower bound. Exit 1 on any loss.
"""

from __future__ import annotations

import argparse
import gzip
import os
import signal
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The collector process helpers live beside the bounded versions of these runs (the
# reliability tests); imported by file name, as pytest does.
sys.path.insert(0, str(ROOT / "tests" / "reliability"))

import httpx
import orjson
from collector import drop_postgres_database, postgres_database
from reliability_procs import CollectorProcess, free_port
from sqlalchemy import func, select

from ampwatch.agent.retry import is_retryable
from ampwatch.agent.wire import INGEST_PATH, LAYER_STATS, WIRE_VERSION
from ampwatch.server.db import make_engine
from ampwatch.server.layer_models import LayerStat
from ampwatch.server.migrate import upgrade
from ampwatch.server.models import Event, IngestedBatch, Run
from ampwatch.server.step_models import Step

STEPS_PER_BATCH = 50
LAYERS = 100
LAYER_EVERY = 10


def wire_body(run: str, seq: int) -> tuple[bytes, int, int]:
    first = seq * STEPS_PER_BATCH + 1
    names = [f"blocks.{i // 4}.layer{i % 4}.weight" for i in range(LAYERS)]
    sampled = [s for s in range(first, first + STEPS_PER_BATCH) if (s - 1) % LAYER_EVERY == 0]
    batch = {
        "wire_version": WIRE_VERSION,
        "run": {"client_run_id": run, "name": run, "project": "default"},
        "stream": "50a4",
        "seq": seq,
        "steps": [{"step": s, "rank": 0, "skipped": False, "loss": 2.0, "loss_scale": 65536.0}
                  for s in range(first, first + STEPS_PER_BATCH)],
        "layer_stats": [{"step": s, "rank": 0, "names": names,
                         "stats": {st: [0.25] * LAYERS for st in LAYER_STATS}} for s in sampled],
        "events": [],
        "dropped": {"steps": 0, "layer_stats": 0, "events": 0},
    }  # fmt: skip
    values = len(sampled) * LAYERS * len(LAYER_STATS)
    return gzip.compress(orjson.dumps(batch), compresslevel=1), STEPS_PER_BATCH, values


def load(url: str, agents: int, seconds: float, tag: str, chaos: CollectorProcess | None = None,
         kill_every: float = 5.0) -> dict[str, float]:  # fmt: skip
    """Agents for `seconds`; with `chaos`, SIGKILL one of its workers every `kill_every` s."""
    lock = threading.Lock()
    latencies: list[float] = []
    totals = {"batches": 0, "steps": 0, "values": 0, "retries": 0, "errors": 0, "kills": 0}
    stop_at = time.monotonic() + seconds
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}

    def agent(index: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            seq = 0
            while time.monotonic() < stop_at:
                body, steps, values = wire_body(f"{tag}-{index}", seq)
                give_up = time.monotonic() + 120
                while True:
                    started = time.perf_counter()
                    try:
                        answer = client.post(INGEST_PATH, content=body, headers=headers)
                        status: int | None = answer.status_code
                    except httpx.HTTPError:
                        status = None
                    if status == 200:
                        with lock:
                            latencies.append(time.perf_counter() - started)
                            totals["batches"] += 1
                            totals["steps"] += steps
                            totals["values"] += values
                        break
                    with lock:
                        totals["retries"] += 1
                    if not is_retryable(status) or time.monotonic() > give_up:
                        with lock:
                            totals["errors"] += 1
                        return
                    time.sleep(0.2)
                seq += 1

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(agents)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    if chaos is not None:
        next_kill = time.monotonic() + kill_every
        while time.monotonic() < stop_at - 1:
            if time.monotonic() >= next_kill:
                next_kill += kill_every
                pids = chaos.worker_pids()
                if pids:
                    os.kill(pids[totals["kills"] % len(pids)], signal.SIGKILL)
                    totals["kills"] += 1
            time.sleep(0.1)
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    latencies.sort()
    return {
        **totals,
        "elapsed": elapsed,
        "p50": latencies[len(latencies) // 2] if latencies else float("nan"),
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        if latencies else float("nan"),
    }  # fmt: skip


def stored(database_url: str, tag: str) -> tuple[int, int, int]:
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            mine = select(Run.id).where(Run.client_run_id.startswith(tag))
            batches = select(func.count()).where(IngestedBatch.run_id.in_(mine))
            return (
                int(connection.scalar(batches) or 0),
                int(connection.scalar(select(func.count()).where(Step.run_id.in_(mine))) or 0),
                int(connection.scalar(select(func.sum(func.length(LayerStat.values) / 8))
                                      .where(LayerStat.run_id.in_(mine))) or 0),
            )  # fmt: skip
    finally:
        engine.dispose()


def report_load(name: str, result: dict[str, float], database_url: str, tag: str) -> bool:
    counted = stored(database_url, tag)
    expected = (int(result["batches"]), int(result["steps"]), int(result["values"]))
    ok = counted == expected and not result["errors"]
    print(
        f"{name:14} {result['elapsed']:6.1f} s: {result['values'] / result['elapsed']:>12,.0f} "
        f"layer values/s {result['steps'] / result['elapsed']:>9,.0f} steps/s  p50 "
        f"{result['p50'] * 1000:.0f} ms p99 {result['p99'] * 1000:.0f} ms  retries "
        f"{int(result['retries'])}  worker kills {int(result['kills'])}  stored {counted} "
        f"acked {expected}: {'records lost 0' if ok else 'LOSS'}",
        flush=True,
    )
    return ok


def training_under_kills(collector: CollectorProcess, database_url: str, kills: int,
                         steps_between: int) -> bool:  # fmt: skip
    """A real FP16 loop with the agent while the collector is killed `kills` times."""
    import torch
    from torch import nn

    from ampwatch.agent import watch
    from ampwatch.agent.delivery import DeliveryOptions

    def make() -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 16))  # fmt: skip
        return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.amp.GradScaler("cpu")

    inputs = torch.randn(32, 64)

    def step(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> float:
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(inputs).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return time.perf_counter() - started

    watched, bare = make(), make()
    for _ in range(30):
        step(*bare)
    handle = watch(*watched, url=collector.url, run=f"soak-{uuid.uuid4().hex[:6]}",
                   flush_interval=0.1, layer_stats_every=LAYER_EVERY,
                   delivery=DeliveryOptions(retry_cap=0.5))  # fmt: skip
    ratios = []
    total = 0
    for _kill in range(kills):
        for _ in range(steps_between):
            ratios.append(step(*watched) / step(*bare))
            total += 1
        collector.kill()
        for _ in range(steps_between):
            ratios.append(step(*watched) / step(*bare))
            total += 1
        collector.start()
    for _ in range(steps_between):
        ratios.append(step(*watched) / step(*bare))
        total += 1
    handle.detach(timeout=60)
    engine = make_engine(database_url)
    deadline = time.monotonic() + 60
    try:
        while True:
            with engine.connect() as connection:
                run_id = connection.scalar(
                    select(Run.id).where(Run.client_run_id == handle.client_run_id)
                )
                steps, distinct = connection.execute(
                    select(func.count(), func.count(func.distinct(Step.step))).where(
                        Step.run_id == run_id
                    )
                ).one()
                ends = connection.scalar(select(func.count()).where(
                    Event.run_id == run_id, Event.kind == "run_end"))  # fmt: skip
            if ends or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        engine.dispose()
    counters = handle.counters
    ok = steps == distinct == total and ends == 1 and counters["hook_errors"] == 0
    print(
        f"{'collector kills':14} {kills} SIGKILLs of supervisor + workers over {total} steps: "
        f"step-time ratio (watched/bare) median {statistics.median(ratios):.2f}, "
        f"{counters['send_failures']} failed sends, {counters['batches_spooled']} spooled, "
        f"stored {steps} steps ({distinct} distinct), run_end x{ends}: "
        f"{'records lost 0, duplicates 0' if ok else 'LOSS OR DUPLICATES'}",
        flush=True,
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="about a minute in all")
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--load-seconds", type=float, default=300.0)
    parser.add_argument("--kills", type=int, default=10, help="whole-collector SIGKILLs")
    args = parser.parse_args()
    if args.quick:
        args.load_seconds, args.kills = 15.0, 2
    database_url = postgres_database()
    if database_url is None:
        return 2
    print(f"{args.agents} agents, {args.workers} workers, PostgreSQL, {os.cpu_count()} CPUs "
          "(agents share them)", flush=True)  # fmt: skip
    upgrade(database_url)
    collector = CollectorProcess(database_url, free_port(), workers=args.workers).start()
    ok = True
    try:
        tag = uuid.uuid4().hex[:8]
        ok &= report_load("load", load(collector.url, args.agents, args.load_seconds, tag),
                          database_url, tag)  # fmt: skip
        tag = uuid.uuid4().hex[:8]
        chaos = load(collector.url, args.agents, max(12.0, args.load_seconds / 2), tag,
                     chaos=collector, kill_every=3.0 if args.quick else 10.0)  # fmt: skip
        ok &= report_load("worker kills", chaos, database_url, tag)
        ok &= training_under_kills(collector, database_url, args.kills,
                                   steps_between=100 if args.quick else 300)  # fmt: skip
    finally:
        collector.stop()
        drop_postgres_database(database_url)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
