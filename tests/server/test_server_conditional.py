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
from sqlalchemy import select
from webhook_receiver import WebhookReceiver
from wire_batches import layer_record, make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server import queries, run_version, series
from ampwatch.server.auth import ensure_project
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.migrate import upgrade
from ampwatch.server.models import Project

RUNS = "/api/v1/runs"
ALERTS = "/api/v1/alerts"


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
    ]


def alert_paths(run_id: int) -> list[str]:
    """The alert lists, tagged by alerts counters (the run's, the project's)."""
    return [f"{RUNS}/{run_id}/alerts", ALERTS, f"{ALERTS}?status=firing"]


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

    # Answers that move without a bump are not tagged: the advisor reads the clock.
    assert "etag" not in client.get(f"{run_path}/advisor").headers


def steady(client: httpx.Client, seq: int, steps: list[int]) -> int:
    """A batch of steps at one loss (`ingest`'s rising loss fires loss_spike)."""
    batch = make_batch(seq, steps=[step_record(s, loss=1.0) for s in steps])
    answer = client.post(INGEST_PATH, content=json.dumps(batch))
    assert answer.status_code == 200, answer.text
    return int(answer.json()["run_id"])


def nan_batch(seq: int, step: int, client_run_id: str = "run-a") -> Any:
    """A batch whose step has a NaN loss: nan_loss fires."""
    return make_batch(seq, client_run_id=client_run_id,
                      steps=[step_record(step, loss=float("nan"))])  # fmt: skip


def test_the_alert_lists_change_with_their_alerts_only(client: httpx.Client) -> None:
    """A batch that writes no alert leaves every alert list as it was (a run's change
    counter would have moved: its steps are new); one that fires an alert changes them
    all; another run's alert, and a run's deletion, the project's."""
    run_id = steady(client, 0, [0, 1, 2])
    paths = alert_paths(run_id)
    tags = {path: assert_unchanged(client, path) for path in paths}

    steady(client, 1, [3, 4])  # no alert: the same tags, 304s
    assert {path: assert_unchanged(client, path) for path in paths} == tags

    fired = client.post(INGEST_PATH, content=json.dumps(nan_batch(2, 5)))
    assert fired.status_code == 200, fired.text
    for path in paths:
        answer = client.get(path, headers={"If-None-Match": tags[path]})
        assert answer.status_code == 200 and answer.headers["etag"] != tags[path], path
        assert [a["rule"] for a in answer.json()["alerts"]] == ["nan_loss"], path
        tags[path] = assert_unchanged(client, path)

    # Another run's alert moves the project's lists, not this run's page.
    fired = client.post(INGEST_PATH, content=json.dumps(nan_batch(0, 1, "other-run")))
    assert fired.status_code == 200, fired.text
    listed = client.get(ALERTS, headers={"If-None-Match": tags[ALERTS]})
    assert listed.status_code == 200 and listed.json()["total"] == 2
    run_alerts = f"{RUNS}/{run_id}/alerts"
    assert assert_unchanged(client, run_alerts) == tags[run_alerts]

    assert client.delete(f"{RUNS}/{run_id}").status_code == 204
    after = client.get(ALERTS, headers={"If-None-Match": listed.headers["etag"]})
    assert after.status_code == 200 and after.json()["total"] == 1


def counted_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """`owner.name` replaced by itself, counted: the list grows by one per call."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_an_alert_list_is_computed_once_per_change_for_every_viewer(
    client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Viewers of the alerts across runs without the tag get the kept page, its tag read in
    the caller's hop (`deps.reads_with_caller`), not in a hop of its own."""
    from ampwatch.server.api import alerts

    calls = counted_calls(monkeypatch, alerts, "_page")
    own_hops = counted_calls(monkeypatch, alerts, "_own_alerts_version")
    steady(client, 0, [0])
    first, second = client.get(ALERTS), client.get(ALERTS)
    assert (first.status_code, second.status_code, len(calls), own_hops) == (200, 200, 1, [])
    assert second.content == first.content and second.headers["etag"] == first.headers["etag"]
    assert client.post(INGEST_PATH, content=json.dumps(nan_batch(1, 1))).status_code == 200
    third = client.get(ALERTS)
    assert len(calls) == 2 and [a["rule"] for a in third.json()["alerts"]] == ["nan_loss"]


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
    calls = counted_calls(monkeypatch, series, "step_series")
    run_id = ingest(client, 0, [0, 1])
    path = f"{RUNS}/{run_id}/steps"
    first, second = client.get(path), client.get(path)
    assert (first.status_code, second.status_code, len(calls)) == (200, 200, 1)
    assert second.content == first.content and second.headers["etag"] == first.headers["etag"]
    assert client.get(f"{path}?max_points=10").status_code == 200 and len(calls) == 2
    ingest(client, 1, [2])
    third = client.get(path)
    assert len(calls) == 3 and third.json()["step"] == [0, 1, 2]


def test_the_alerts_counter_moves_once_per_commit_that_noted_a_change(db_url: str) -> None:
    """`run_version.note_project_alerts` bumps at the commit, once however many notes; a
    rollback forgets them (a savepoint's keeps the earlier ones)."""
    upgrade(db_url)
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)

    def version() -> int:
        with sessions() as session:
            return int(session.scalar(select(Project.alerts_version).where(Project.name == "p")))

    try:
        with sessions() as session:
            ensure_project(session, "p")
            session.commit()
        assert version() == 0
        with sessions() as session:
            session.execute(select(1))  # notes follow their writes, in their transaction
            run_version.note_project_alerts(session, "p")
            session.rollback()
            session.commit()
        assert version() == 0
        with sessions() as session:
            session.execute(select(1))
            run_version.note_project_alerts(session, "p")
            run_version.note_project_alerts(session, "p")
            with pytest.raises(RuntimeError), session.begin_nested():
                raise RuntimeError("a failed evaluation")
            session.commit()
        assert version() == 1
    finally:
        engine.dispose()
