"""Body size limits, concurrent writers, and the mounted dashboard."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from wire_batches import layer_record, make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH

Starter = Callable[..., AbstractContextManager[Any]]


def test_body_larger_than_the_limit_is_413_compressed_or_not(
    sqlite_url: str, start_collector: Starter
) -> None:
    batch = make_batch(0, steps=[step_record(i, loss=1.0) for i in range(200)])
    raw = json.dumps(batch).encode()
    assert len(gzip.compress(raw)) < 2048 < len(raw)  # a small gzip that inflates too far
    with (
        start_collector(sqlite_url, dashboard=False, max_body_bytes=2048) as live,
        httpx.Client(base_url=live.url) as client,
    ):
        plain = client.post(INGEST_PATH, content=raw)
        assert plain.status_code == 413
        assert "larger than 2048 bytes" in plain.json()["detail"]
        inflated = client.post(
            INGEST_PATH, content=gzip.compress(raw), headers={"Content-Encoding": "gzip"}
        )
        assert inflated.status_code == 413
        assert client.get("/api/v1/runs").json()["runs"] == []


def test_every_route_bounds_its_body_declared_or_chunked(
    sqlite_url: str, start_collector: Starter
) -> None:
    """`body_limit.BodyLimit`: not only ingest (before, `POST /api/v1/runs` read a body of
    any size); a body sent without a length is cut off where it passes the limit."""
    body = json.dumps({"client_run_id": "r", "name": "x" * 4096}).encode()

    def chunked() -> Any:
        yield from (body[i : i + 512] for i in range(0, len(body), 512))

    with (
        start_collector(sqlite_url, dashboard=False, max_body_bytes=2048) as live,
        httpx.Client(base_url=live.url) as client,
    ):
        for method, path in (("POST", "/api/v1/runs"), ("PUT", "/api/v1/runs/1/alert-config"),
                             ("POST", "/api/v1/webhooks"), ("POST", INGEST_PATH)):  # fmt: skip
            for content in (body, chunked()):
                answer = client.request(method, path, content=content,
                                        headers={"Content-Type": "application/json"})  # fmt: skip
                assert answer.status_code == 413, (method, path, answer.text)
                assert "larger than 2048 bytes" in answer.json()["detail"]
        assert client.post(
            "/api/v1/runs", json={"client_run_id": "r", "name": "n"}
        ).status_code in (200, 201)
        assert [run["client_run_id"] for run in client.get("/api/v1/runs").json()["runs"]] == ["r"]


def test_concurrent_batches_of_one_new_run_all_land(client: httpx.Client) -> None:
    """Writers race for the run row, the batch rows and new layer indices; none may fail."""
    n_batches = 8
    responses: list[httpx.Response] = []
    barrier = threading.Barrier(n_batches)

    def send(seq: int) -> None:
        batch = make_batch(
            seq,
            steps=[step_record(seq, loss=float(seq))],
            layer_stats=[layer_record(seq, [f"layer{seq}", "shared"], [0.5, float(seq)])],
        )
        with httpx.Client(base_url=str(client.base_url), timeout=60) as own:
            barrier.wait()
            responses.append(own.post(INGEST_PATH, content=json.dumps(batch)))

    threads = [threading.Thread(target=send, args=(seq,)) for seq in range(n_batches)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(r.status_code for r in responses) == [200] * n_batches, [
        r.text for r in responses
    ]
    (run,) = client.get("/api/v1/runs").json()["runs"]
    assert run["steps"] == n_batches
    matrix = client.get(f"/api/v1/runs/{run['id']}/layers").json()
    shared = matrix["layers"].index("shared")
    assert [row[shared] for row in matrix["values"]] == [float(s) for s in range(n_batches)]
    assert len(matrix["layers"]) == n_batches + 1


def test_dashboard_is_mounted_and_root_redirects(live_collector: Any) -> None:
    if not live_collector.settings.dashboard:
        pytest.skip("ampwatch.dashboard.app is not importable yet")
    with httpx.Client(base_url=live_collector.url, timeout=30) as client:
        root = client.get("/")
        assert root.status_code in (302, 307)
        assert root.headers["location"] == "/dashboard/"
        page = client.get("/dashboard/")
        assert page.status_code == 200
        assert "<html" in page.text.lower()
