"""Admission: two lanes per collector process, so that ingest is never queued behind reads.

- The ingest lane: `POST /api/v1/ingest`, at most `ingest_threads` batches worked on at once.
- The read lane: every other API request, at most `worker_threads` at once.
- No lane: `/healthz` (liveness must not look dead under load) and the dashboard's pages
  (Dash runs on a2wsgi's own threads, and its callbacks read through the read lane: a
  page holding a read turn while its own API read waits for one could deadlock).

Why lanes: with one queue for everything (a semaphore of 32 turns, before), 1,000 clients
reading runs while 32 agents ingested on 2 cores kept an agent's batch waiting as long as
a read (p50 24 s), so every alert arrived ~25 s late. Now a batch waits only for other
batches. Why this shape (a semaphore per lane, each admitted request holding at most one
worker thread at a time): the endpoints are sync functions run on anyio's default thread
limiter, which `main.create_app` sizes to `worker_threads + ingest_threads`. A request
uses the threads one after another (caller, session, endpoint), never two at once, so the
read lane can hold at most `worker_threads` of them and `ingest_threads` are always free
for ingest -- a guarantee, not a priority that load could wear down. A turn is held until
the request ends, its session's close included: ending it when the answer started let the
next read start while the last one's close still ran on a thread of its own (FastAPI's
exit limiter), and /healthz p99 under 200 concurrent reads rose past 5 s in 3 of 4 runs
(tests/server/test_server_concurrency.py, load average ~4.5; held to the end, 6 of 6
passed). A task waiting on a semaphore is not runnable, so the event loop's queue stays
short and `/healthz` is answered in milliseconds; throughput is
unchanged (the CPU, not the number of requests in flight, bounds it). Waiting requests are
not refused: a client sees latency, never a 503.

Measured (`bench/load.py`, 20-30 s, with the turn then ending as the answer started, on
a 2-core machine shared with other work, load average 8-13, the bench at nice 10; old and
new interleaved): ingest batch p50 37 s -> 11 s
(SQLite) and 27 s -> 14 s (PostgreSQL) under 1,000 readers and 32 agents; 5.3 s -> 1.5 s
and 4.6 s -> 2.1 s under 200 readers and 8 agents, alert p50 8.9 s -> 3.7 s and
7.5 s -> 2.5 s. What is left is the CPU: a lane keeps a batch from waiting for a turn or
a thread, not from sharing the GIL and the cores with the reads in progress.

Alert delivery has its own lane already: a thread of its own (`webhook_delivery`), woken
as soon as an ingest queued a notification.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from starlette.types import ASGIApp, Receive, Scope, Send

from ampwatch.agent.wire import INGEST_PATH

#: Paths answered without waiting for a turn: liveness must not look dead under load.
UNQUEUED_PATHS = frozenset({"/healthz"})
Lane = Literal["ingest", "read"]


def lane_of(scope: Scope, unqueued_mount: str = "") -> Lane | None:
    """The lane of a request (None: it waits for no turn); `unqueued_mount`: the
    dashboard's mount (`main.DASHBOARD_PATH`).

    >>> lane_of({"type": "http", "method": "POST", "path": "/api/v1/ingest"})
    'ingest'
    >>> lane_of({"type": "http", "method": "GET", "path": "/api/v1/runs"})
    'read'
    >>> lane_of({"type": "http", "method": "GET", "path": "/healthz"}) is None
    True
    >>> lane_of({"type": "http", "method": "GET", "path": "/dashboard/"}, "/dashboard") is None
    True
    """
    path = scope.get("path", "")
    if scope["type"] != "http" or path in UNQUEUED_PATHS:
        return None
    if unqueued_mount and (path == unqueued_mount or path.startswith(unqueued_mount + "/")):
        return None
    if path == INGEST_PATH and scope.get("method") == "POST":
        return "ingest"
    return "read"


class AdmissionLimit:
    """ASGI middleware; add it outermost (`main.create_app`)."""

    def __init__(self, app: ASGIApp, *, reads: int, ingests: int, unqueued_mount: str) -> None:
        self.app = app
        self._unqueued_mount = unqueued_mount
        self.lanes: dict[Lane, asyncio.Semaphore] = {
            "read": asyncio.Semaphore(reads),
            "ingest": asyncio.Semaphore(ingests),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = lane_of(scope, self._unqueued_mount)
        if lane is None:
            await self.app(scope, receive, send)
            return
        async with self.lanes[lane]:
            await self.app(scope, receive, send)
