"""Load: 1,000 concurrent API clients (dashboard-like reads) plus 64 ingesting agents for a
bounded time, then 1,000 concurrent clients with bogus tokens; on SQLite (one worker) and
PostgreSQL (two workers).

    python bench/load.py                          # both backends, 1,000 clients, 30 s each
    python bench/load.py --quick                  # SQLite, 200 clients, 8 agents, 5 s
    python bench/load.py --backend postgres --clients 1000 --agents 64 --seconds 60

Bars (exit 1 when missed): zero errors (every read 200, every batch acknowledged, every
bogus request 401; a timeout, a refused connection or a 5xx is an error) and `/healthz`
p99 under 100 ms throughout. Reads' and ingest's p50/p99 are reported. Before the
collector closed a request's session with its endpoint (`api.deps.SessionRoute`), 200
concurrent reads froze it: 0 of 200 answered, `/healthz` timed out for ~2 minutes.

The clients run in two processes beside the collector and `/healthz` is probed from a
third (so its latency is the collector's, not a busy client's event loop): on a 2-core
machine they all take CPU from the collector, so the figures are a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import secrets
import ssl
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reliability"))  # wire_batch, as bench/soak.py

import httpx
from collector import drop_postgres_database, postgres_database, start_server

from ampwatch.agent.wire import INGEST_PATH

HEALTH_BAR_SECONDS = 0.100
CLIENT_PROCESSES = 2
PROBE_INTERVAL = 0.02
#: A request not answered in this long counts as an error (the freeze answered after 30 s).
REQUEST_TIMEOUT = 60.0
STEPS_PER_BATCH = 50
LAYERS = 64
#: One TLS context for every client (plain HTTP here): each new one loads the CA bundle,
#: ~10 ms of CPU, which 1,000 clients would spend before their first request.
_TLS = ssl.create_default_context()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def probe_health(url: str, seconds: float, results: Any) -> None:
    """Its own process: GET /healthz every PROBE_INTERVAL for `seconds`."""
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT) as client:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                status = client.get("/healthz").status_code
                if status != 200:
                    errors[f"healthz {status}"] += 1
            except httpx.HTTPError as error:
                errors[f"healthz {type(error).__name__}"] += 1
            latencies.append(time.perf_counter() - started)
            time.sleep(PROBE_INTERVAL)
    results.put({"health": latencies, "errors": dict(errors)})


async def _readers(
    url: str, token: str, clients: int, run_ids: list[int], deadline: float, out: dict[str, Any]
) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    paths = ["/api/v1/runs", "/api/v1/alerts"]
    per_run = ["", "/steps", "/layers?stat=zero_fraction", "/alerts", "/events"]

    async def reader() -> None:
        rng = random.Random()
        # One client (one connection) per reader, as 1,000 browsers would be; one shared
        # pool of 500 connections spent most of the load's CPU in httpcore's pool scans.
        async with httpx.AsyncClient(
            base_url=url, timeout=REQUEST_TIMEOUT, headers=headers, verify=_TLS
        ) as client:
            while time.monotonic() < deadline:
                if rng.random() < 0.3 or not run_ids:
                    path = rng.choice(paths)
                else:
                    path = f"/api/v1/runs/{rng.choice(run_ids)}{rng.choice(per_run)}"
                started = time.perf_counter()
                try:
                    status = (await client.get(path)).status_code
                except httpx.HTTPError as error:
                    out["errors"][f"read {type(error).__name__}"] += 1
                    continue
                out["reads"].append(time.perf_counter() - started)
                if status != 200:
                    out["errors"][f"read {status}"] += 1

    await asyncio.gather(*(reader() for _ in range(clients)))


async def _agents(
    url: str, token: str, agents: int, tag: str, deadline: float, out: dict[str, Any]
) -> None:
    from reliability_support import wire_batch

    headers = {
        "Authorization": f"Bearer {token}",
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
    }
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT, headers=headers) as client:

        async def agent(index: int) -> None:
            seq = 1  # seq 0 was the seeding batch
            while time.monotonic() < deadline:
                body, steps, _ = wire_batch(
                    f"{tag}-{index}", seq, steps_per_batch=STEPS_PER_BATCH, layers=LAYERS,
                    layer_every=10, project="bench",
                )  # fmt: skip
                started = time.perf_counter()
                try:
                    answer = await client.post(INGEST_PATH, content=body)
                except httpx.HTTPError as error:
                    out["errors"][f"ingest {type(error).__name__}"] += 1
                    continue  # the agent retries the same seq
                out["ingest"].append(time.perf_counter() - started)
                if answer.status_code != 200:
                    out["errors"][f"ingest {answer.status_code}"] += 1
                    continue
                out["steps"] += steps
                seq += 1

        await asyncio.gather(*(agent(i) for i in range(agents)))


async def _bogus(url: str, clients: int, deadline: float, out: dict[str, Any]) -> None:
    async def caller() -> None:
        rng = random.Random()
        async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT, verify=_TLS) as client:
            while time.monotonic() < deadline:
                # A well-formed unknown token (looked up by prefix), or garbage.
                token = rng.choice(
                    [f"aw_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}", "nope", "aw__"]
                )
                path = rng.choice(["/api/v1/runs", "/api/v1/runs/1/steps", INGEST_PATH])
                method = "POST" if path == INGEST_PATH else "GET"
                started = time.perf_counter()
                try:
                    answer = await client.request(
                        method, path, headers={"Authorization": f"Bearer {token}"},
                        content=b"{}" if method == "POST" else None,
                    )  # fmt: skip
                except httpx.HTTPError as error:
                    out["errors"][f"bogus {type(error).__name__}"] += 1
                    continue
                out["reads"].append(time.perf_counter() - started)
                if answer.status_code != 401:
                    out["errors"][f"bogus {answer.status_code}"] += 1

    await asyncio.gather(*(caller() for _ in range(clients)))


def client_process(task: dict[str, Any], results: Any) -> None:
    """Its own process: one share of the readers and agents (or bogus callers), at a
    lower CPU priority than the collector, whose latency is what is measured."""
    os.nice(5)
    out: dict[str, Any] = {"reads": [], "ingest": [], "steps": 0, "errors": Counter()}
    deadline = time.monotonic() + task["seconds"]

    async def main() -> None:
        if task["bogus"]:
            await _bogus(task["url"], task["clients"], deadline, out)
            return
        await asyncio.gather(
            _readers(task["url"], task["token"], task["clients"], task["run_ids"], deadline, out),
            _agents(task["url"], task["token"], task["agents"], task["tag"], deadline, out),
        )

    asyncio.run(main())
    out["errors"] = dict(out["errors"])
    results.put(out)


def seed(url: str, token: str, agents: int, tag: str) -> list[int]:
    """Each agent's first batch (seq 0): the runs exist before the readers start."""
    from reliability_support import wire_batch

    headers = {"Authorization": f"Bearer {token}", "Content-Encoding": "gzip"}
    run_ids = []
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT, headers=headers) as client:
        for index in range(agents):
            body, _, _ = wire_batch(
                f"{tag}-{index}", 0, steps_per_batch=STEPS_PER_BATCH, layers=LAYERS,
                layer_every=10, project="bench",
            )  # fmt: skip
            answer = client.post(INGEST_PATH, content=body)
            answer.raise_for_status()
            run_ids.append(int(answer.json()["run_id"]))
    return run_ids


def phase(
    url: str, *, seconds: float, clients: int, agents: int, token: str, run_ids: list[int],
    bogus: bool,
) -> dict[str, Any]:  # fmt: skip
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    tag = secrets.token_hex(3)
    probe = context.Process(target=probe_health, args=(url, seconds, results))
    workers = [
        context.Process(target=client_process, args=({
            "url": url, "token": token, "seconds": seconds, "bogus": bogus, "run_ids": run_ids,
            "clients": clients // CLIENT_PROCESSES + (i < clients % CLIENT_PROCESSES),
            "agents": agents // CLIENT_PROCESSES + (i < agents % CLIENT_PROCESSES),
            "tag": f"{tag}{i}",
        }, results))
        for i in range(CLIENT_PROCESSES)
    ]  # fmt: skip
    for process in (probe, *workers):
        process.start()
    merged: dict[str, Any] = {"reads": [], "ingest": [], "steps": 0, "health": [],
                              "errors": Counter()}  # fmt: skip
    for _ in range(1 + len(workers)):
        part = results.get(timeout=seconds + 4 * REQUEST_TIMEOUT)
        for key in ("reads", "ingest", "health"):
            merged[key] += part.get(key, [])
        merged["steps"] += part.get("steps", 0)
        merged["errors"].update(part["errors"])
    for process in (probe, *workers):
        process.join(timeout=30)
    return merged


def report(name: str, result: dict[str, Any], seconds: float) -> bool:
    health = result["health"]
    health_p99 = percentile(health, 0.99)
    errors = sum(result["errors"].values())
    ok = errors == 0 and health_p99 < HEALTH_BAR_SECONDS
    reads = result["reads"]
    line = (
        f"{name:<28} reads {len(reads) / seconds:7.0f}/s p50 {percentile(reads, 0.5) * 1e3:6.0f} ms"
        f" p99 {percentile(reads, 0.99) * 1e3:6.0f} ms"
    )
    if result["ingest"]:
        ingest = result["ingest"]
        line += (
            f" | ingest {len(ingest) / seconds:5.1f} batches/s ({result['steps'] / seconds:6.0f}"
            f" steps/s) p99 {percentile(ingest, 0.99) * 1e3:6.0f} ms"
        )
    line += (
        f" | healthz p50 {percentile(health, 0.5) * 1e3:4.1f} p99 {health_p99 * 1e3:5.1f}"
        f" max {max(health, default=float('nan')) * 1e3:6.1f} ms ({len(health)} probes)"
        f" | errors {errors} {dict(result['errors']) or ''} {'ok' if ok else 'MISSED'}"
    )
    print(line, flush=True)
    return ok


def run_backend(backend: str, args: argparse.Namespace) -> bool:
    from ampwatch.server import auth
    from ampwatch.server.db import make_engine, make_sessionmaker
    from ampwatch.server.migrate import upgrade

    with tempfile.TemporaryDirectory(prefix="ampwatch-load-") as folder:
        if backend == "sqlite":
            database_url, workers = f"sqlite:///{folder}/load.db", 1
        else:
            created = postgres_database()
            if created is None:
                return True
            database_url, workers = created, args.workers
        try:
            upgrade(database_url)
            engine = make_engine(database_url)
            with make_sessionmaker(engine)() as session:
                token = auth.create_token(session, project="bench").token
            engine.dispose()
            process, url = start_server(database_url, workers=workers)
            try:
                run_ids = seed(url, token, args.agents, secrets.token_hex(3))
                label = f"{backend} ({workers} worker{'s' * (workers > 1)})"
                load = phase(url, seconds=args.seconds, clients=args.clients, agents=args.agents,
                             token=token, run_ids=run_ids, bogus=False)  # fmt: skip
                ok = report(f"{label}: {args.clients} readers + {args.agents} agents", load,
                            args.seconds)  # fmt: skip
                bogus = phase(url, seconds=args.seconds, clients=args.clients, agents=0,
                              token=token, run_ids=[], bogus=True)  # fmt: skip
                ok &= report(f"{label}: {args.clients} bogus tokens", bogus, args.seconds)
            finally:
                process.terminate()
                process.wait(timeout=30)
        finally:
            if backend == "postgres":
                drop_postgres_database(database_url)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=2, help="collector workers (PostgreSQL)")
    parser.add_argument("--quick", action="store_true", help="SQLite, 200 clients, 8 agents, 5 s")
    args = parser.parse_args()
    if args.quick:
        args.backend, args.clients, args.agents, args.seconds = "sqlite", 200, 8, 5.0
    print(f"{os.cpu_count()} CPUs; clients in {CLIENT_PROCESSES} processes, /healthz probed "
          f"every {PROBE_INTERVAL * 1e3:.0f} ms from another", flush=True)  # fmt: skip
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    results = [run_backend(backend, args) for backend in backends]  # every one, even after a miss
    ok = all(results)
    print("bars: 0 errors, /healthz p99 < 100 ms:", "met" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
