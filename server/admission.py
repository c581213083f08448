"""Admission: two lanes per collector process, so that an agent's batch -- and the alerts it
fires -- is never queued behind reads.

- The ingest lane: `POST /api/v1/ingest`, at most `ingest_in_flight` batches taken in at
  once and relayed to the ingest process (`ingest_pool`), which stores them one after
  another: a deep lane keeps the next batches read and queued there while one is stored
  (with 2, as many as there were ingest threads, batches waited ~1 s for a turn at 32
  batches/s: a turn lasted the caller's hop, the relay and the store, ~65 ms).
- The read lane: every other API request, at most `worker_threads` at once.
- No lane: `/healthz` (liveness must not look dead under load) and the dashboard's pages
  (Dash runs on a2wsgi's own threads, and its callbacks read through the read lane: a
  page holding a read turn while its own API read waits for one could deadlock).

Why lanes: with one queue for everything (a semaphore of 32 turns, before), 1,000 clients
reading runs while 32 agents ingested on 2 cores kept an agent's batch waiting as long as
a read (p50 24 s), so every alert arrived ~25 s late. Why this shape (a turn per lane,
each admitted request holding at most one worker thread at a time): the endpoints are
sync functions run on anyio's default thread limiter, which `main.create_app` sizes to
`worker_threads + ingest_threads`. A request uses the threads one after another (caller,
session, endpoint), never two at once, so the read lane can hold at most `worker_threads`
of them and `ingest_threads` are always free for ingest (whose caller is resolved on one).
A turn is held until the request ends, its session's close included: ending it when the
answer started let the next read start while the last one's close still ran on a thread
of its own (FastAPI's exit limiter), and /healthz p99 under 200 concurrent reads rose past
5 s in 3 of 4 runs (tests/server/test_server_concurrency.py, load average ~4.5; held to
the end, 6 of 6 passed). A task waiting for a turn is not runnable, so the event loop's
queue stays short and `/healthz` is answered in milliseconds. Waiting requests are not
refused: a client sees latency, never a 503.

Before batches were stored in a process of their own, a lane kept a batch from waiting
for a turn, not from sharing this process's one GIL with the reads in progress, so reads
paused while a batch was worked on: batches were then on time, and reads took the gaps
between them (~50-90 reads/s under `bench/load.py`'s 1,000 readers and 32 agents, p99
~25 s). With the ingest process there is nothing to pause for.

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
        #: Turns, admitted in arrival order (asyncio's semaphore wakes its waiters FIFO).
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
