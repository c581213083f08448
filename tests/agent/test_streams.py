"""Several agent processes on one run id, against a real collector on SQLite and PostgreSQL.

Every rank of a distributed run shares the client run id, and a run restarted from a
checkpoint reuses it; each process numbers its batches from seq 0. Only the per-process
`stream` id keeps the collector from taking rank 1's batches (or the resumed run's) for
duplicates of rank 0's.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
from sqlalchemy import text
from torch import nn

from ampwatch.agent import attach, watch
from ampwatch.agent.http_transport import Transport, http_transport, post, request_headers
from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server.db import make_engine

STEPS = 12
EVERY = 3
SAMPLED = len(range(1, STEPS + 1, EVERY))
RUN_ID = "shared-run"


class _Rank:
    """One simulated process: its own model, optimizer, scaler and watch() handle."""

    def __init__(
        self, rank: int, url: str, monkeypatch: pytest.MonkeyPatch, bodies: list[bytes]
    ) -> None:
        info = {"torch_version": torch.__version__, "host": "h", "pid": 1, "world_size": 2}
        monkeypatch.setattr(attach, "process_info", lambda: {**info, "rank": rank})
        torch.manual_seed(rank)
        self.model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.scaler = torch.amp.GradScaler("cpu")
        send = http_transport(url)

        def recording(body: bytes, headers: dict[str, str]) -> int:
            bodies.append(body)
            status: int = send(body, headers)
            return status

        transport: Transport = recording
        self.handle = watch(
            self.model, self.optimizer, self.scaler, run_id=RUN_ID, transport=transport,
            layer_stats_every=EVERY, flush_interval=0.02,
        )  # fmt: skip

    def step(self) -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = self.model(torch.randn(4, 8)).float().pow(2).mean()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()


def _rows(database_url: str, sql: str) -> list[tuple[Any, ...]]:
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            return [tuple(row) for row in connection.execute(text(sql))]
    finally:
        engine.dispose()


def test_two_ranks_and_a_resumed_process_on_one_run_id_are_all_stored(
    db_url: str,
    start_collector: Callable[..., AbstractContextManager[Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bodies: dict[str, list[bytes]] = {"rank0": [], "rank1": [], "resumed": []}
    with start_collector(db_url, dashboard=False) as live:
        rank0 = _Rank(0, live.url, monkeypatch, bodies["rank0"])
        rank1 = _Rank(1, live.url, monkeypatch, bodies["rank1"])
        for _ in range(STEPS):  # interleaved, as two ranks' senders are
            rank0.step()
            rank1.step()
        for process in (rank0, rank1):
            process.handle.detach(timeout=20)
            assert process.handle.counters["batches_sent"] >= 1
            assert process.handle.counters["batches_rejected"] == 0

        def q(sql: str) -> list[tuple[Any, ...]]:
            return _rows(live.database_url, sql)

        assert q("SELECT rank, COUNT(*), MIN(step), MAX(step) FROM steps GROUP BY rank") == [
            (0, STEPS, 1, STEPS)
        ]
        assert q(
            "SELECT rank, COUNT(DISTINCT step) FROM layer_stats GROUP BY rank ORDER BY rank"
        ) == [(0, SAMPLED), (1, SAMPLED)]
        assert q("SELECT COUNT(DISTINCT stream) FROM ingested_batches") == [(2,)]
        assert q("SELECT COUNT(*) FROM ingested_batches WHERE seq = 0") == [(2,)]

        # A restart from a checkpoint: the same run id, a new process, seq from 0 again.
        resumed = _Rank(0, live.url, monkeypatch, bodies["resumed"])
        for _ in range(STEPS + 2):
            resumed.step()
        resumed.handle.detach(timeout=20)
        assert q("SELECT COUNT(*), MAX(step) FROM steps WHERE rank = 0") == [(STEPS + 2, STEPS + 2)]
        assert q("SELECT COUNT(DISTINCT stream) FROM ingested_batches") == [(3,)]
        starts = q("SELECT kind, COUNT(*) FROM events GROUP BY kind ORDER BY kind")
        assert ("run_start", 3) in starts and ("run_end", 3) in starts

        # A batch re-sent by its own stream is still a duplicate and changes nothing.
        tables = ("steps", "layer_stats", "events", "ingested_batches")
        counts = [q(f"SELECT COUNT(*) FROM {table}") for table in tables]
        for body in (bodies["rank1"][0], bodies["resumed"][-1]):
            status, answer = post(live.url + INGEST_PATH, body, request_headers(None), timeout=10)
            assert status == 200 and b'"duplicate":true' in answer
        assert [q(f"SELECT COUNT(*) FROM {table}") for table in tables] == counts
