"""Concurrency against a real collector: many requests at once never freeze it, and two
tenants racing first batches of one client run id each get their own run.

Small on purpose (CI runs on 2 cores); `bench/load.py` is the 1,000-client version.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from wire_batches import make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server import auth, migrate
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.serving import BackgroundCollector, bind_socket
from ampwatch.server.settings import Settings

#: Before the session closed with its endpoint, 200 concurrent reads froze the collector
#: (every answer a 30 s pool timeout or a client timeout); now they take ~1-2 s.
CONCURRENT = 200
ADMIN = "admin-secret-for-concurrency"


async def _storm(url: str, token: str) -> tuple[Counter[object], list[float]]:
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=CONCURRENT + 8)
    async with httpx.AsyncClient(base_url=url, timeout=20, limits=limits) as client:

        async def read(path: str) -> object:
            try:
                return (await client.get(path, headers=headers)).status_code
            except httpx.HTTPError as error:
                return type(error).__name__

        async def health() -> list[float]:
            latencies = []
            for _ in range(10):
                started = time.perf_counter()
                assert (await client.get("/healthz")).status_code == 200
                latencies.append(time.perf_counter() - started)
            return latencies

        reads = [read("/api/v1/runs") for _ in range(CONCURRENT)]
        *statuses, latencies = await asyncio.gather(*reads, health())
    return Counter(statuses), latencies


def test_concurrent_reads_never_freeze_the_collector(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    with start_collector(db_url, dashboard=False, admin_token=ADMIN) as live:
        statuses, health_latencies = asyncio.run(_storm(live.url, ADMIN))
    assert statuses == Counter({200: CONCURRENT})
    # /healthz is answered on the event loop, not behind the busy worker threads: frozen, it
    # took the 30 s pool timeout. Typically <= 1.6 s here, even with 3 CPU burners on 2
    # cores; one answer of ten took 7 s once in CI on a loaded machine (the client shares
    # this process's GIL with the collector), so one stall is allowed, not a slow median.
    # The latency bar itself is bench/load.py's (/healthz p99 under 1,000 clients).
    assert statistics.median(health_latencies) < 5.0, health_latencies
    assert max(health_latencies) < 15.0, health_latencies


def _tokens(database_url: str) -> dict[str, str]:
    engine = make_engine(database_url)
    with make_sessionmaker(engine)() as session:
        tokens = {p: auth.create_token(session, project=p).token for p in ("vision", "nlp")}
    engine.dispose()
    return tokens


def test_two_tenants_racing_one_client_run_id_get_a_run_each(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    """The probe: both tenants' agents name their run after the job, and their first
    batches arrive together. Each must land in its own project's run, with only its own
    steps, and neither may be refused its own run."""
    rounds = 6
    with start_collector(db_url, dashboard=False, admin_token=ADMIN) as live:
        tokens = _tokens(db_url)
        first_step = {"vision": 0, "nlp": 1000}
        answers: dict[tuple[int, str], httpx.Response] = {}
        for round_ in range(rounds):
            barrier = threading.Barrier(len(tokens))

            def first_batch(project: str, round_: int = round_, barrier: Any = barrier) -> None:
                batch: dict[str, Any] = dict(make_batch(
                    0, client_run_id=f"job-{round_}",
                    steps=[step_record(first_step[project] + i, loss=1.0) for i in range(5)],
                ))  # fmt: skip
                batch["run"] = {**batch["run"], "project": project}
                headers = {"Authorization": f"Bearer {tokens[project]}"}
                barrier.wait()
                answers[(round_, project)] = httpx.post(
                    live.url + INGEST_PATH, json=batch, headers=headers, timeout=30
                )

            threads = [threading.Thread(target=first_batch, args=(p,)) for p in tokens]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for round_ in range(rounds):
            ids = set()
            for project in tokens:
                answer = answers[(round_, project)]
                assert answer.status_code == 200, answer.text
                run_id = answer.json()["run_id"]
                ids.add(run_id)
                run = httpx.get(f"{live.url}/api/v1/runs/{run_id}", headers=admin).json()
                assert (run["project"], run["client_run_id"]) == (project, f"job-{round_}")
                assert (run["steps"], run["last_step"]) == (5, first_step[project] + 4)
            assert len(ids) == 2
        listed = httpx.get(f"{live.url}/api/v1/runs", headers=admin).json()
        assert listed["total"] == 2 * rounds


@pytest.mark.parametrize("freeze_heap", [True, False])
def test_the_startup_heap_is_frozen_while_serving_and_released_after(
    sqlite_url: str, freeze_heap: bool
) -> None:
    """Full collections must not walk the start-up heap while serving (`server/heap.py`);
    the process gets it back when the collector stops. A collector embedded in a host
    process (`BackgroundCollector`'s default) leaves the host's heap alone."""
    import gc

    migrate.upgrade(sqlite_url)
    sock = bind_socket()
    settings = Settings(database_url=sqlite_url, port=sock.getsockname()[1], dashboard=False)
    assert gc.get_freeze_count() == 0
    with BackgroundCollector(settings, sock=sock, freeze_heap=freeze_heap) as live:
        assert httpx.get(f"{live.url}/healthz").status_code == 200
        assert (gc.get_freeze_count() > 10_000) == freeze_heap
    assert gc.get_freeze_count() == 0
