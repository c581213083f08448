"""Admission: at most `max_active_requests` requests per collector process are worked on at
once; the rest wait, parked, for a turn. `/healthz` never waits.

Why: with 1,000 clients connected, every request in progress is a task on the one event
loop, and the loop serves its ready tasks in turn: a `/healthz` probe queued behind
hundreds of them (p99 550 ms with 1,000 bogus-token clients on SQLite). A task waiting
on a semaphore is not runnable, so the loop's queue stays short and a probe is answered in
milliseconds, while throughput is unchanged (the CPU, not the number of requests in
flight, bounds it). Waiting requests are not refused: a client sees latency, never a 503.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

#: Paths answered without waiting for a turn: liveness must not look dead under load.
UNQUEUED_PATHS = frozenset({"/healthz"})


class AdmissionLimit:
    """ASGI middleware; add it outermost (`main.create_app`)."""

    def __init__(self, app: ASGIApp, *, max_active: int) -> None:
        self.app = app
        self._turns = asyncio.Semaphore(max_active)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNQUEUED_PATHS:
            await self.app(scope, receive, send)
            return
        async with self._turns:
            await self.app(scope, receive, send)
