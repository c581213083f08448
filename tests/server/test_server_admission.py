"""Two lanes (`server/admission.py`): driven through the ASGI middleware itself, with an app
whose requests end only when the test says, so every ordering is decided by the test and
none by a clock."""

from __future__ import annotations

import asyncio
from typing import Any

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server.admission import AdmissionLimit


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


def test_a_batch_is_admitted_while_every_read_turn_is_taken() -> None:
    async def test() -> None:
        app = Gated()
        limit = AdmissionLimit(app, reads=2, ingests=1, unqueued_mount="")
        reads = [asyncio.create_task(_request(limit, f"read {i}")) for i in range(3)]
        await _settle()
        body: asyncio.Queue[bytes] = asyncio.Queue()
        batch = asyncio.create_task(_request(limit, "batch", body))
        body.put_nowait(b"{}")
        body.put_nowait(b"")
        await _settle()
        assert app.started == ["read 0", "read 1", "batch"]  # read 2 waits for a read turn
        app.end("batch")
        app.end("read 0")
        await _settle()
        assert app.started[-1] == "read 2"
        app.end("read 1")
        app.end("read 2")
        await asyncio.gather(batch, *reads)

    _run(test)


def test_reads_run_while_a_batch_is_worked_on() -> None:
    """The ingest process stores the batch: nothing in this process to pause reads for."""

    async def test() -> None:
        app = Gated()
        limit = AdmissionLimit(app, reads=2, ingests=2, unqueued_mount="")
        body: asyncio.Queue[bytes] = asyncio.Queue()
        batch = asyncio.create_task(_request(limit, "batch", body))
        body.put_nowait(b"")
        await _settle()
        reads = [asyncio.create_task(_request(limit, f"read {i}")) for i in range(2)]
        await _settle()
        assert app.started == ["batch", "read 0", "read 1"]
        for name in ("batch", "read 0", "read 1"):
            app.end(name)
        await asyncio.gather(batch, *reads)

    _run(test)


def test_each_lane_admits_in_arrival_order() -> None:
    async def test() -> None:
        app = Gated()
        limit = AdmissionLimit(app, reads=1, ingests=1, unqueued_mount="")
        names = [f"read {i}" for i in range(3)] + [f"batch {i}" for i in range(3)]
        tasks = []
        for name in names:
            body: asyncio.Queue[bytes] | None = None
            if name.startswith("batch"):
                body = asyncio.Queue()
                body.put_nowait(b"")
            tasks.append(asyncio.create_task(_request(limit, name, body)))
            await _settle()
        assert app.started == ["read 0", "batch 0"]  # one turn a lane
        for i in range(1, 3):
            app.end(f"read {i - 1}")
            app.end(f"batch {i - 1}")
            await _settle()
            assert app.started[-2:] == [f"read {i}", f"batch {i}"]
        app.end("read 2")
        app.end("batch 2")
        await asyncio.gather(*tasks)

    _run(test)


def test_a_cancelled_request_gives_its_turn_back() -> None:
    async def test() -> None:
        app = Gated()
        limit = AdmissionLimit(app, reads=1, ingests=1, unqueued_mount="")
        body: asyncio.Queue[bytes] = asyncio.Queue()
        batch = asyncio.create_task(_request(limit, "batch", body))
        body.put_nowait(b"")
        held = asyncio.create_task(_request(limit, "held"))
        await _settle()
        waiting = asyncio.create_task(_request(limit, "gone"))  # its client hangs up
        await _settle()
        waiting.cancel()
        held.cancel()  # mid-work: its turn comes back all the same
        batch.cancel()
        await _settle()
        read = asyncio.create_task(_request(limit, "read"))
        second: asyncio.Queue[bytes] = asyncio.Queue()
        second.put_nowait(b"")
        again = asyncio.create_task(_request(limit, "batch again", second))
        await _settle()
        assert app.started == ["batch", "held", "read", "batch again"]
        app.end("read")
        app.end("batch again")
        await asyncio.gather(read, again)
        assert all(not lane.locked() for lane in limit.lanes.values())

    _run(test)
