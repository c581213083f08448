"""Reads yield to ingest (`server/admission.py`): driven through the ASGI middleware itself,
with an app whose requests end only when the test says, so every ordering is decided by
the test and none by a clock (`read_patience` is 0 or an hour)."""

from __future__ import annotations

import asyncio
from typing import Any

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server.admission import AdmissionLimit

HOUR = 3600.0


class Gated:
    """An ASGI app: each request reads its body, says it started, and ends when released."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        name = scope["name"]
        while (await receive()).get("more_body"):
            pass
        self.started.append(name)
        await self.release.setdefault(name, asyncio.Event()).wait()

    def end(self, name: str) -> None:
        self.release.setdefault(name, asyncio.Event()).set()


def _scope(name: str, method: str, path: str) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "name": name}


async def _request(
    limit: AdmissionLimit, name: str, body_parts: asyncio.Queue[bytes] | None = None
) -> None:
    """A read (GET /api/v1/runs), or a batch whose body arrives part by part from
    `body_parts` (b"" ends it)."""
    if body_parts is None:

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        await limit(_scope(name, "GET", "/api/v1/runs"), receive, None)  # type: ignore[arg-type]
        return

    async def receive_part() -> dict[str, Any]:
        part = await body_parts.get()
        return {"type": "http.request", "body": part, "more_body": part != b""}

    await limit(_scope(name, "POST", INGEST_PATH), receive_part, None)  # type: ignore[arg-type]


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def _run(test: Any) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=30))


def test_no_read_starts_while_a_batch_is_worked_on_and_running_reads_finish() -> None:
    async def test() -> None:
        app = Gated()
        limit = AdmissionLimit(app, reads=4, ingests=2, unqueued_mount="", read_patience=HOUR)
        early = asyncio.create_task(_request(limit, "early read"))
        await _settle()
        body: asyncio.Queue[bytes] = asyncio.Queue()
        batch = asyncio.create_task(_request(limit, "batch", body))
        body.put_nowait(b"{}")
        body.put_nowait(b"")
        await _settle()
        late = [asyncio.create_task(_request(limit, f"read {i}")) for i in range(3)]
        await _settle()
        assert app.started == ["early read", "batch"]  # 3 of 4 read turns free, none taken
        app.end("early read")  # a read in progress is never cut short
        await _settle()
        assert early.done() and app.started == ["early read", "batch"]
        app.end("batch")
        await _settle()
        assert batch.done()
        assert sorted(app.started[2:]) == ["read 0", "read 1", "read 2"]  # all 4 turns back
        for i in range(3):
            app.end(f"read {i}")
        await asyncio.gather(*late)

    _run(test)


def test_a_batch_still_uploading_holds_no_read() -> None:
    async def test() -> None:
        app = Gated()
        limit = AdmissionLimit(app, reads=2, ingests=2, unqueued_mount="", read_patience=HOUR)
        body: asyncio.Queue[bytes] = asyncio.Queue()
        batch = asyncio.create_task(_request(limit, "batch", body))
        body.put_nowait(b"{")  # a slow agent: part of its body, then nothing for a while
        await _settle()
        read = asyncio.create_task(_request(limit, "read"))
        await _settle()
        assert app.started == ["read"]
        body.put_nowait(b"}")
        body.put_nowait(b"")
        await _settle()
        assert app.started == ["read", "batch"]
        app.end("read")
        app.end("batch")
        await asyncio.gather(read, batch)

    _run(test)


def test_reads_that_waited_their_patience_run_beside_the_batches_one_at_a_time() -> None:
    async def test() -> None:
        app = Gated()
        limit = AdmissionLimit(app, reads=4, ingests=2, unqueued_mount="", read_patience=0.0)
        body: asyncio.Queue[bytes] = asyncio.Queue()
        batch = asyncio.create_task(_request(limit, "batch", body))
        body.put_nowait(b"")
        await _settle()
        overdue = [asyncio.create_task(_request(limit, f"read {i}")) for i in range(2)]
        await _settle()
        assert app.started == ["batch", "read 0"]  # never starved, never two beside it
        app.end("read 0")
        await _settle()
        assert app.started == ["batch", "read 0", "read 1"]
        app.end("read 1")
        app.end("batch")
        await asyncio.gather(batch, *overdue)
        assert limit.reads.total_tokens == 4 and limit.reads.borrowed_tokens == 0

    _run(test)


def test_reads_resume_only_when_the_last_of_two_batches_ends() -> None:
    async def test() -> None:
        app = Gated()
        limit = AdmissionLimit(app, reads=2, ingests=2, unqueued_mount="", read_patience=HOUR)
        bodies = [asyncio.Queue[bytes]() for _ in range(2)]
        batches = [
            asyncio.create_task(_request(limit, f"batch {i}", q)) for i, q in enumerate(bodies)
        ]
        for q in bodies:
            q.put_nowait(b"")
        await _settle()
        read = asyncio.create_task(_request(limit, "read"))
        app.end("batch 0")
        await _settle()
        assert app.started == ["batch 0", "batch 1"]
        app.end("batch 1")
        await _settle()
        assert app.started[-1] == "read"
        app.end("read")
        await asyncio.gather(read, *batches)

    _run(test)


def test_a_cancelled_request_gives_its_turn_back() -> None:
    async def test() -> None:
        app = Gated()
        limit = AdmissionLimit(app, reads=1, ingests=1, unqueued_mount="", read_patience=HOUR)
        body: asyncio.Queue[bytes] = asyncio.Queue()
        batch = asyncio.create_task(_request(limit, "batch", body))
        body.put_nowait(b"")
        await _settle()
        waiting = asyncio.create_task(_request(limit, "gone"))  # its client hangs up
        await _settle()
        waiting.cancel()
        batch.cancel()  # mid-work: the reads' turns come back all the same
        await _settle()
        read = asyncio.create_task(_request(limit, "read"))
        await _settle()
        assert app.started == ["batch", "read"]
        app.end("read")
        await read
        assert limit.reads.total_tokens == 1 and limit.reads.borrowed_tokens == 0

    _run(test)
