"""Load: 1,000 concurrent API clients (dashboard-like reads) plus 32 ingesting agents for a
bounded time, then 1,000 concurrent clients with bogus tokens; on SQLite (one worker) and
PostgreSQL (two workers). Alerts are timed end to end: from the step's wall time on the
training host to a real webhook receiver's arrival.

    python bench/load.py                          # both backends, 1,000 clients, 30 s each
    python bench/load.py --quick                  # SQLite, 200 clients, 8 agents, 5 s
    python bench/load.py --backend postgres --clients 1000 --agents 32 --seconds 60

Each agent behaves as the real one: it seals a batch of the steps of the last
`FLUSH_INTERVAL` (the agent's default `flush_interval`) and POSTs it, in order; every
`NAN_EVERY`-th batch holds a step with a NaN loss, so nan_loss fires (and resolves on the
next 100 finite steps). A step's wall time is its place in the batch's window, so an
alert's latency counts the agent's own wait for the flush (up to 1 s) too. Readers poll
as the dashboard's client does: they send back the ETag they got (`If-None-Match`), and a
304 is a success.

Bars (exit 1 when missed): zero errors (every read 200 or 304, every batch acknowledged,
every alert at the receiver within `ALERT_GRACE` of the load's end, every bogus request
401; a timeout, a refused connection or a 5xx is an error), `/healthz` p99 under 100 ms
throughout, ingest batch p99 < 1 s, alert p99 < 2 s, reads >= 300/s with p99 < 2 s.
Before the collector closed a request's session with its endpoint
(`api.deps.SessionRoute`), 200 concurrent reads froze it: 0 of 200 answered, `/healthz`
timed out for ~2 minutes. Before ingest had a lane of its own (`server/admission.py`), a batch waited as long as a
read: p50 24 s under 1,000 readers, and so did every alert. With a lane but in the
collector's process, it shared one GIL with the reads: either reads paused for batches
(batches on time, reads ~50-70/s, p99 ~25 s) or batches waited for reads (5.6 of 32
batches/s). Now batches are stored by an ingest process (`server/ingest_pool.py`), and
the reads' process runs at a lower CPU priority: on SQLite, 32.0 batches/s stored (p50
91 ms, p99 1.6 s), alert p99 2.1 s, reads 206/s (p99 8.4 s). With a run's alerts page kept
by its change counter too (`api.conditional`), on a quiet machine: SQLite 32.9 batches/s
(p99 0.4-1.2 s), alert p99 1.2-1.3 s, reads 256-286/s (p99 4.6-5.5 s), /healthz p99
27-36 ms; PostgreSQL, two workers: 30.8 batches/s (p99 2.2 s), alert p99 1.9 s, reads
64/s, /healthz p99 145 ms; one worker (`--workers 1`): 30.2 batches/s (p99 1.6 s), alert
p99 2.3 s, reads 84/s, /healthz p99 55 ms.

Where the CPU goes is printed after each load phase (`print_cpu`). On this 2-core machine
the collector uses all of it (machine idle 1-8%): on SQLite the ingest process spends
~27 ms of CPU a batch (32 agents: ~0.85 of a core; ~22 ms a batch alone in-process, the
rule engine about half of it) and the serving process ~4 ms a read (~2.7 ms one at a
time, `bench/read_cost.py`: the alerts across runs ~6.5-9 ms, the runs list ~3-4.5 ms,
a kept run answer ~1-1.8 ms), so reads get what ingest leaves: 177-252/s over five runs
of one day. Tagging the alert lists by their project's alerts counter (`/alerts` unchanged:
7.2 -> 2.9 ms) moved nothing this bench can tell from its noise: interleaved, 173 and
225 reads/s with it, 237 and 222 without; where ingest fell behind (~27 batches/s, ~33 ms
a batch), reads fell to ~173/s either way. Ingest runs at the higher priority, and when it nears its capacity (~28-32
batches/s under the load) its p50 climbs to ~1 s. On PostgreSQL (two workers) the ingest
processes spend ~42-47 ms a batch and a read ~7-9 ms, the database's own processes
besides: 47-57 reads/s. p99 < 2 s under 1,000 closed-loop readers needs >= 500 reads/s
(Little's law: mean latency = readers / throughput), so both costs must about halve.
On a faster 2-core machine the same code gave SQLite 542-556 reads/s (p99 2.4-2.7 s,
1.6 ms a read) and PostgreSQL 182/s. Then the reads stopped building ORM objects and
statements per request (the caller's token and path run, the alert lists' tags, the runs
list: table columns, built once), the caller's lookup ran on a Core connection, the
request's session was made on the event loop (two worker-thread hops fewer) and the read
threads went from 4 to 2 (`worker_threads`): SQLite 810 / 861 reads/s (p50 1.2-1.3 s,
p99 1.70 / 1.75 s, 1.04-1.08 ms a read), ingest p99 0.26 s, alert p99 1.0-1.1 s, every
bar met; PostgreSQL 252 / 304 reads/s (p99 ~9 s, ~2 ms a read, the machine 2% idle: the
database and two ingest processes share the cores), ingest p99 0.96 / 1.5 s.

The clients run in two processes beside the collector and `/healthz` is probed from a
third (so its latency is the collector's, not a busy client's event loop): on a 2-core
machine they all take CPU from the collector, so the figures are a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import secrets
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reliability"))  # wire_batch, as bench/soak.py

import httpx
from collector import (
    collector_cpu_seconds,
    drop_postgres_database,
    machine_idle_seconds,
    postgres_database,
    start_server,
)
from raw_http import Connection, ReadError

from ampwatch.agent.wire import INGEST_PATH

HEALTH_BAR_SECONDS = 0.100
INGEST_BAR_SECONDS = 1.0
ALERT_BAR_SECONDS = 2.0
READS_BAR_PER_SECOND = 300.0
READ_BAR_SECONDS = 2.0
#: The agent's default flush interval (`watch(flush_interval=1.0)`).
FLUSH_INTERVAL = 1.0
#: A NaN loss every this many batches: nan_loss fires, and resolves 100 finite steps later.
NAN_EVERY = 4
#: How long after the load the receiver may still get the alerts its last batches fired.
ALERT_GRACE = 15.0
CLIENT_PROCESSES = 2
PROBE_INTERVAL = 0.02
#: A request not answered in this long counts as an error (the freeze answered after 30 s).
REQUEST_TIMEOUT = 60.0
STEPS_PER_BATCH = 50
LAYERS = 64


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class AlertReceiver:
    """A real webhook receiver (stdlib HTTP server, a thread of this process): the arrival
    time of each firing alert, by (client run id, fired step)."""

    def __init__(self) -> None:
        self.arrivals: dict[tuple[str, int], float] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                arrived = time.time()
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                if body.get("transition") == "firing":
                    key = (body["run"]["client_run_id"], int(body["alert"]["fired_step"]))
                    receiver.arrivals.setdefault(key, arrived)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/alerts"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def alert_latencies(
    receiver: AlertReceiver, nan_steps: list[tuple[str, int, float]], errors: Counter[str]
) -> list[float]:
    """Seconds from each NaN step's wall time to its alert's arrival, waiting up to
    `ALERT_GRACE` for the last ones; an alert that never arrives is an error."""
    deadline = time.monotonic() + ALERT_GRACE
    while time.monotonic() < deadline and not all(
        (run, step) in receiver.arrivals for run, step, _ in nan_steps
    ):
        time.sleep(0.1)
    latencies = []
    for run, step, wall in nan_steps:
        arrived = receiver.arrivals.get((run, step))
        if arrived is None:
            errors["alert never arrived"] += 1
        else:
            latencies.append(arrived - wall)
    return latencies


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
        # One connection per reader, as 1,000 browsers would be (`raw_http`: httpx cost the
        # readers ~3.5 ms of CPU a request, as much as the collector's answer).
        connection = Connection(url, headers, REQUEST_TIMEOUT)
        tags: dict[str, str] = {}  # as the dashboard's client keeps them
        while time.monotonic() < deadline:
            if rng.random() < 0.3 or not run_ids:
                path = rng.choice(paths)
            else:
                path = f"/api/v1/runs/{rng.choice(run_ids)}{rng.choice(per_run)}"
            held = {"If-None-Match": tags[path]} if path in tags else None
            started = time.perf_counter()
            try:
                status, answer, _ = await connection.request("GET", path, held)
            except ReadError as error:
                out["errors"][f"read {error}"] += 1
                continue
            out["reads"].append(time.perf_counter() - started)
            if status == 304:
                out["unchanged"] += 1
            elif status != 200:
                out["errors"][f"read {status}"] += 1
            elif "etag" in answer:
                tags[path] = answer["etag"]
        await connection.close()

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
            # Agents start spread over one flush interval, as independent jobs would.
            window_start = time.time() - random.random() * FLUSH_INTERVAL
            while time.monotonic() < deadline:
                await asyncio.sleep(max(0.0, window_start + FLUSH_INTERVAL - time.time()))
                sealed = time.time()
                nan_step = None
                if seq % NAN_EVERY == 0:  # its steps ran evenly over [window_start, sealed]
                    place = random.randrange(STEPS_PER_BATCH)
                    nan_step = seq * STEPS_PER_BATCH + 1 + place
                    nan_step += nan_step % 97 == 0  # a skipped step's loss is no nan_loss
                    place = nan_step - seq * STEPS_PER_BATCH - 1
                    wall = window_start + (sealed - window_start) * (place + 1) / STEPS_PER_BATCH
                    out["nan_steps"].append((f"{tag}-{index}", nan_step, wall))
                window_start = sealed
                body, steps, _ = wire_batch(
                    f"{tag}-{index}", seq, steps_per_batch=STEPS_PER_BATCH, layers=LAYERS,
                    layer_every=10, project="bench", nan_step=nan_step,
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
        connection = Connection(url, {}, REQUEST_TIMEOUT)
        while time.monotonic() < deadline:
            # A well-formed unknown token (looked up by prefix), or garbage.
            token = rng.choice(
                [f"aw_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}", "nope", "aw__"]
            )
            path = rng.choice(["/api/v1/runs", "/api/v1/runs/1/steps", INGEST_PATH])
            method = "POST" if path == INGEST_PATH else "GET"
            started = time.perf_counter()
            try:
                status, _, _ = await connection.request(
                    method, path, {"Authorization": f"Bearer {token}"},
                    b"{}" if method == "POST" else b"",
                )  # fmt: skip
            except ReadError as error:
                out["errors"][f"bogus {error}"] += 1
                continue
            out["reads"].append(time.perf_counter() - started)
            if status != 401:
                out["errors"][f"bogus {status}"] += 1
        await connection.close()

    await asyncio.gather(*(caller() for _ in range(clients)))


def client_process(task: dict[str, Any], results: Any) -> None:
    """Its own process: one share of the readers and agents (or bogus callers), at a
    lower CPU priority than the collector, whose latency is what is measured."""
    os.nice(5)
    if task["agents"]:
        # Imported before the clock starts: it imports torch, seconds on a loaded machine
        # during which the first import inside the load blocked every reader's event loop.
        import reliability_support  # noqa: F401
    out: dict[str, Any] = {"reads": [], "ingest": [], "steps": 0, "unchanged": 0,
                           "nan_steps": [], "errors": Counter()}  # fmt: skip
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
                              "unchanged": 0, "nan_steps": [], "errors": Counter()}  # fmt: skip
    for _ in range(1 + len(workers)):
        part = results.get(timeout=seconds + 4 * REQUEST_TIMEOUT)
        for key in ("reads", "ingest", "health", "nan_steps"):
            merged[key] += part.get(key, [])
        for key in ("steps", "unchanged"):
            merged[key] += part.get(key, 0)
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
        f" p99 {percentile(reads, 0.99) * 1e3:6.0f} ms ({result['unchanged']} were 304)"
    )
    if "alerts" in result:  # the phase with agents: its bars (an empty one misses them)
        ingest, alerts = result["ingest"], result["alerts"]
        ok &= len(reads) / seconds >= READS_BAR_PER_SECOND
        ok &= percentile(reads, 0.99) < READ_BAR_SECONDS
        ok &= percentile(ingest, 0.99) < INGEST_BAR_SECONDS
        ok &= bool(alerts) and percentile(alerts, 0.99) < ALERT_BAR_SECONDS
        line += (
            f" | ingest {len(ingest) / seconds:5.1f} batches/s ({result['steps'] / seconds:6.0f}"
            f" steps/s) p50 {percentile(ingest, 0.5) * 1e3:5.0f}"
            f" p99 {percentile(ingest, 0.99) * 1e3:6.0f} ms"
            f" | alerts {len(alerts)} p50 {percentile(alerts, 0.5) * 1e3:5.0f}"
            f" p99 {percentile(alerts, 0.99) * 1e3:6.0f} ms"
        )
    line += (
        f" | healthz p50 {percentile(health, 0.5) * 1e3:4.1f} p99 {health_p99 * 1e3:5.1f}"
        f" max {max(health, default=float('nan')) * 1e3:6.1f} ms ({len(health)} probes)"
        f" | errors {errors} {dict(result['errors']) or ''} {'ok' if ok else 'MISSED'}"
    )
    print(line, flush=True)
    return ok


def print_cpu(result: dict[str, Any], used: dict[str, float], idle: float) -> None:
    """Where the collector's CPU went during the load (`collector.collector_cpu_seconds`):
    per read in the serving processes (ingest's HTTP side included), per batch in the
    ingest processes (the notification worker's deliveries and sweeps included), and the
    machine's idle share: what explains a run's figures on a shared machine."""
    reads, batches = len(result["reads"]), len(result["ingest"])
    print(
        f"{'':<28} collector CPU: serving {used['serving']:5.1f} s"
        f" ({1e3 * used['serving'] / max(reads, 1):4.2f} ms a read), ingest"
        f" {used['ingest']:5.1f} s ({1e3 * used['ingest'] / max(batches, 1):4.1f} ms a batch)"
        f" | machine idle {idle:.0%}",
        flush=True,
    )


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
            receiver = AlertReceiver()
            # The receiver listens on loopback, which webhooks reach only when allow-listed.
            os.environ["AMPWATCH_WEBHOOK_ALLOWED_NETWORKS"] = "127.0.0.1/32"
            process, url = start_server(database_url, workers=workers)
            try:
                hook = httpx.post(f"{url}/api/v1/webhooks", json={"url": receiver.url},
                                  headers={"Authorization": f"Bearer {token}"})  # fmt: skip
                hook.raise_for_status()
                run_ids = seed(url, token, args.agents, secrets.token_hex(3))
                label = f"{backend} ({workers} worker{'s' * (workers > 1)})"
                cpu_before, idle_before = collector_cpu_seconds(process.pid), machine_idle_seconds()
                load = phase(url, seconds=args.seconds, clients=args.clients, agents=args.agents,
                             token=token, run_ids=run_ids, bogus=False)  # fmt: skip
                cpu = collector_cpu_seconds(process.pid)
                idle = machine_idle_seconds()
                load["alerts"] = alert_latencies(receiver, load["nan_steps"], load["errors"])
                ok = report(f"{label}: {args.clients} readers + {args.agents} agents", load,
                            args.seconds)  # fmt: skip
                print_cpu(load, {k: cpu[k] - cpu_before[k] for k in cpu},
                          (idle[0] - idle_before[0]) / (idle[1] - idle_before[1]))  # fmt: skip
                if not args.no_bogus:
                    bogus = phase(url, seconds=args.seconds, clients=args.clients, agents=0,
                                  token=token, run_ids=[], bogus=True)  # fmt: skip
                    ok &= report(f"{label}: {args.clients} bogus tokens", bogus, args.seconds)
            finally:
                process.terminate()
                process.wait(timeout=30)
                receiver.close()
        finally:
            if backend == "postgres":
                drop_postgres_database(database_url)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=2, help="collector workers (PostgreSQL)")
    parser.add_argument("--quick", action="store_true", help="SQLite, 200 clients, 8 agents, 5 s")
    parser.add_argument("--no-bogus", action="store_true", help="skip the bogus-token phase")
    args = parser.parse_args()
    if args.quick:
        args.backend, args.clients, args.agents, args.seconds = "sqlite", 200, 8, 5.0
    print(f"{os.cpu_count()} CPUs; clients in {CLIENT_PROCESSES} processes, /healthz probed "
          f"every {PROBE_INTERVAL * 1e3:.0f} ms from another", flush=True)  # fmt: skip
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    results = [run_backend(backend, args) for backend in backends]  # every one, even after a miss
    ok = all(results)
    print("bars: 0 errors, /healthz p99 < 100 ms, ingest p99 < 1 s, alert p99 < 2 s, reads "
          ">= 300/s with p99 < 2 s:", "met" if ok else "MISSED")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
