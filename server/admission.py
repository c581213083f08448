"""Admission: two lanes per collector process, and reads that yield to ingest, so that an
agent's batch -- and the alerts it fires -- is never queued behind reads.

- The ingest lane: `POST /api/v1/ingest`, at most `ingest_threads` batches worked on at once.
- The read lane: every other API request, at most `worker_threads` at once, and none
  started while a batch is being worked on (its body in, its answer not yet sent), except
  a read that has waited `READ_PATIENCE`: those run beside the batches, one at a time.
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
of them and `ingest_threads` are always free for ingest. A turn is held until the request
ends, its session's close included: ending it when the answer started let the next read
start while the last one's close still ran on a thread of its own (FastAPI's exit
limiter), and /healthz p99 under 200 concurrent reads rose past 5 s in 3 of 4 runs
(tests/server/test_server_concurrency.py, load average ~4.5; held to the end, 6 of 6
passed). A task waiting for a turn is not runnable, so the event loop's queue stays short
and `/healthz` is answered in milliseconds. Waiting requests are not refused: a client
sees latency, never a 503.

Why reads yield: a lane keeps a batch from waiting for a turn or a thread, not from
sharing the one GIL with the reads in progress. With 4 read threads beside 2 ingest
threads, ingest got about a third of it: under 1,000 readers 32 agents (a batch ~20 ms of
CPU) were answered 5.6 batches/s of the 32 they sent, p50 6.5 s; with one read beside
ingest 18 batches/s. With no read started while a batch is worked on, 32 batches/s,
p50 0.3 s (`bench/load.py`, SQLite, 20 s runs on 2 cores). Reads then take the gaps
between batches. Only a batch whose body has arrived pauses them: an agent uploading
slowly holds nothing. `READ_PATIENCE` bounds the wait when batches leave no gaps (more
ingest than the process can keep up with): reads slow down, one at a time, never starve.

Alert delivery has its own lane already: a thread of its own (`webhook_delivery`), woken
as soon as an ingest queued a notification.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ampwatch.agent.wire import INGEST_PATH

#: Paths answered without waiting for a turn: liveness must not look dead under load.
UNQUEUED_PATHS = frozenset({"/healthz"})
Lane = Literal["ingest", "read"]
#: Seconds a read waits for a pause in ingest before it runs beside the batches (one such
#: read at a time): it bounds starvation, not ordinary waits. Under 1,000 closed-loop
#: readers and 32 agents (bench/load.py, SQLite, 2 cores) reads wait ~20 s for a gap; with
#: 10 s here the overdue reads ran beside ingest most of the time and took its share back
#: (21 batches/s of 32, alert p99 5.5 s); with 30 s, 32 of 32.
READ_PATIENCE = 30.0


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

    def __init__(
        self,
        app: ASGIApp,
        *,
        reads: int,
        ingests: int,
        unqueued_mount: str,
        read_patience: float = READ_PATIENCE,
    ) -> None:
        self.app = app
        self._unqueued_mount = unqueued_mount
        self._read_turns = reads
        self._patience = read_patience
        #: Its tokens drop to 0 while a batch is worked on (`_working`): running reads
        #: finish, new ones wait (anyio's limiter admits in arrival order).
        self.reads = anyio.CapacityLimiter(reads)
        self.overdue_reads = asyncio.Semaphore(1)
        self.ingests = asyncio.Semaphore(ingests)
        self._working = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = lane_of(scope, self._unqueued_mount)
        if lane is None:
            await self.app(scope, receive, send)
        elif lane == "ingest":
            await self._ingest(scope, receive, send)
        else:
            await self._read(scope, receive, send)

    async def _read(self, scope: Scope, receive: Receive, send: Send) -> None:
        admitted = False
        with anyio.move_on_after(self._patience):
            await self.reads.acquire()
            admitted = True
        if not admitted:  # batches left no gap for READ_PATIENCE: beside them, one at a time
            async with self.overdue_reads:
                await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.reads.release()

    async def _ingest(self, scope: Scope, receive: Receive, send: Send) -> None:
        working = False

        async def body_in() -> Message:
            nonlocal working
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body") and not working:
                working = True
                self._working += 1
                self.reads.total_tokens = 0
            return message

        try:
            async with self.ingests:
                await self.app(scope, body_in, send)
        finally:
            if working:
                self._working -= 1
                if not self._working:
                    self.reads.total_tokens = self._read_turns
