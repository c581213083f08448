"""Reads cheap to repeat, and ingest in a lane of its own (`server/api/conditional.py`,
`server/run_version.py`, `server/admission.py`), over real HTTP on both backends."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from webhook_receiver import WebhookReceiver
from wire_batches import layer_record, make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server import queries, series

RUNS = "/api/v1/runs"


def ingest(client: httpx.Client, seq: int, steps: list[int]) -> int:
    batch = make_batch(
        seq,
        steps=[step_record(s, loss=1.0 + s) for s in steps],
        layer_stats=[layer_record(s, ["fc1", "fc2"], [0.1, 0.2]) for s in steps],
    )
    answer = client.post(INGEST_PATH, content=json.dumps(batch))
    assert answer.status_code == 200, answer.text
    return int(answer.json()["run_id"])


def run_paths(run_id: int) -> list[str]:
    """Every run answer the dashboard polls that is tagged by the run's change counter."""
    run = f"{RUNS}/{run_id}"
    return [
        run,
        f"{run}/steps",
        f"{run}/layers?stat=zero_fraction",
        f"{run}/layers/fc1/series",
        f"{run}/events",
        f"{run}/checkpoints",
        f"{run}/alerts",
    ]


def assert_unchanged(client: httpx.Client, path: str) -> str:
    """The path's tag; asking again with it is a 304 with no body and the same tag."""
    first = client.get(path)
    assert first.status_code == 200, (path, first.text)
    tag = first.headers["etag"]
    assert first.headers["cache-control"] == "no-cache"
    again = client.get(path, headers={"If-None-Match": tag})
    assert (again.status_code, again.content, again.headers["etag"]) == (304, b"", tag), path
    return tag


def test_unchanged_run_answers_are_304_and_every_change_is_a_200(client: httpx.Client) -> None:
    run_id = ingest(client, 0, [0, 1, 2])
    paths = [*run_paths(run_id), RUNS]
    tags = {path: assert_unchanged(client, path) for path in paths}

    ingest(client, 1, [3])  # a new batch: every answer is new
    for path in paths:
        answer = client.get(path, headers={"If-None-Match": tags[path]})
        assert answer.status_code == 200, path
        assert answer.headers["etag"] != tags[path], path
        tags[path] = assert_unchanged(client, path)
    steps = client.get(f"{RUNS}/{run_id}/steps", headers={"If-None-Match": "*"})
    assert steps.status_code == 304
    assert client.get(f"{RUNS}/{run_id}/steps").json()["step"] == [0, 1, 2, 3]
    assert client.get(RUNS).json()["runs"][0]["last_step"] == 3

    # Not only ingest: the run's thresholds move the step series' rule lines, and its end
    # is in the run's answer.
    steps_path, run_path = f"{RUNS}/{run_id}/steps", f"{RUNS}/{run_id}"
    rules = {"rules": {"loss_scale_collapse": {"min_scale": 4.0}}}
    assert client.put(f"{RUNS}/{run_id}/alert-config", json=rules).status_code == 200
    moved = client.get(steps_path, headers={"If-None-Match": tags[steps_path]})
    assert moved.status_code == 200
    assert moved.json()["rule_lines"]["loss_scale"]["min_scale"] == 4.0
    assert client.post(f"{run_path}/end").status_code == 200
    ended = client.get(run_path, headers={"If-None-Match": tags[run_path]})
    assert (ended.status_code, ended.json()["status"]) == (200, "ended")

    # Answers that move without a bump are not tagged: the alerts across runs, the advisor.
    assert "etag" not in client.get("/api/v1/alerts").headers


def test_a_tag_of_another_run_or_a_deleted_one_is_not_honoured(client: httpx.Client) -> None:
    run_id = ingest(client, 0, [0])
    tag = client.get(f"{RUNS}/{run_id}/steps").headers["etag"]
    assert client.delete(f"{RUNS}/{run_id}").status_code == 204
    assert client.get(f"{RUNS}/{run_id}/steps", headers={"If-None-Match": tag}).status_code == 404
    again = ingest(client, 0, [0])  # SQLite may give the new run the deleted one's id
    fresh = client.get(f"{RUNS}/{again}/steps", headers={"If-None-Match": tag})
    assert fresh.status_code == 200 and fresh.headers["etag"] != tag


@pytest.fixture
def blocked_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, Any]]:
    """The runs list blocks inside its endpoint until released: (release, entered(n))."""
    release = threading.Event()
    inside = threading.Semaphore(0)
    real = queries.list_runs

    def blocking(*args: Any, **kwargs: Any) -> Any:
        inside.release()
        assert release.wait(60), "never released"
        return real(*args, **kwargs)

    def entered(count: int) -> None:
        for _ in range(count):
            assert inside.acquire(timeout=60), "the reads never started"

    monkeypatch.setattr(queries, "list_runs", blocking)
    yield release, entered
    release.set()


def test_an_ingest_is_answered_while_every_read_turn_is_taken(
    db_url: str,
    start_collector: Callable[..., AbstractContextManager[Any]],
    blocked_reads: tuple[threading.Event, Any],
) -> None:
    release, entered = blocked_reads
    reads_lane = 2
    with start_collector(db_url, dashboard=False, worker_threads=reads_lane) as live:
        answers: list[int] = []

        def read() -> None:
            with httpx.Client(base_url=live.url, timeout=60) as reader:
                answers.append(reader.get(RUNS).status_code)

        readers = [threading.Thread(target=read) for _ in range(reads_lane + 3)]
        for thread in readers:
            thread.start()
        entered(reads_lane)  # every read turn is taken, by reads that do not end
        with httpx.Client(base_url=live.url, timeout=30) as agent:
            run_id = ingest(agent, 0, [0, 1])  # before: waited for a thread held by a read
            assert not release.is_set() and answers == []
            release.set()
            for thread in readers:
                thread.join(60)
            assert answers == [200] * len(readers)
            assert agent.get(f"{RUNS}/{run_id}").json()["last_step"] == 1


def test_an_ingest_that_queues_a_notification_wakes_the_delivery(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    with (
        WebhookReceiver() as receiver,
        start_collector(
            db_url,
            dashboard=False,
            notify_interval=3600.0,  # no round of its own during the test
            webhook_allowed_networks=["127.0.0.1/32"],
        ) as live,
        httpx.Client(base_url=live.url, timeout=30) as client,
    ):
        hook = client.post("/api/v1/webhooks", json={"url": receiver.url("/hook")})
        assert hook.status_code == 201, hook.text
        batch = make_batch(0, steps=[step_record(0, loss=1.0), step_record(1, loss=float("nan"))])
        answer = client.post(INGEST_PATH, content=json.dumps(batch))
        assert answer.status_code == 200, answer.text
        [body] = receiver.wait_for("/hook", 1, timeout=20)
        assert (body["alert"]["rule"], body["transition"]) == ("nan_loss", "firing")


def test_a_run_answer_is_computed_once_per_change_for_every_viewer(
    client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Viewers without the tag get the kept answer (`TaggedAnswers`): one query per change."""
    calls: list[int] = []
    real = series.step_series

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(series, "step_series", counted)
    run_id = ingest(client, 0, [0, 1])
    path = f"{RUNS}/{run_id}/steps"
    first, second = client.get(path), client.get(path)
    assert (first.status_code, second.status_code, len(calls)) == (200, 200, 1)
    assert second.content == first.content and second.headers["etag"] == first.headers["etag"]
    assert client.get(f"{path}?max_points=10").status_code == 200 and len(calls) == 2
    ingest(client, 1, [2])
    third = client.get(path)
    assert len(calls) == 3 and third.json()["step"] == [0, 1, 2]
