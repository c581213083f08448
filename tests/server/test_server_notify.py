"""Webhook delivery: a live collector's worker POSTing to a real HTTP receiver."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from webhook_receiver import WebhookReceiver
from wire_batches import make_batch, step_record

from ampwatch.agent.retry import is_retryable, retry_delay
from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server.auth import ensure_project
from ampwatch.server.db import begin_write, make_engine, make_sessionmaker
from ampwatch.server.migrate import upgrade
from ampwatch.server.models import Alert, Notification, Run, Webhook, utcnow
from ampwatch.server.outbox import enqueue
from ampwatch.server.settings import Settings
from ampwatch.server.webhook_delivery import (
    DeliveryWorker,
    http_client,
    post,
)
from ampwatch.server.webhook_formats import run_page_url

#: For tests whose subject does not depend on the database.
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
#: Fast rounds and retries, so that a test sees three attempts within a second.
#: The receivers here listen on 127.0.0.1, which webhooks may reach only when an operator
#: allow-lists it (the default refuses loopback: tests/server/test_server_webhook_client.py).
FAST = {
    "notify_interval": 0.05, "webhook_retry_base": 0.05, "webhook_timeout": 2.0,
    "webhook_allowed_networks": ["127.0.0.1/32"],
}  # fmt: skip


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as server:
        yield server


@pytest.fixture
def fast_collector(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> Iterator[Any]:
    with start_collector(db_url, dashboard=False, webhook_max_attempts=3, **FAST) as live:
        yield live


@pytest.fixture
def api(fast_collector: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{fast_collector.url}/api/v1", timeout=30) as http:
        yield http


def ingest_run(api: httpx.Client, client_run_id: str = "run-a", project: str = "default") -> int:
    batch = make_batch(0, client_run_id=client_run_id, steps=[step_record(0, loss=1.0)])
    batch["run"]["project"] = project
    response = api.post(INGEST_PATH.removeprefix("/api/v1"), json=dict(batch))
    assert response.status_code == 200, response.text
    return int(response.json()["run_id"])


def fire_alert(
    database_url: str,
    run_id: int,
    *,
    severity: str = "critical",
    transition: str = "firing",
    layer: str = "",
) -> tuple[int, int]:
    """Do what the alert engine does: move an alert and enqueue, in one transaction.
    Returns (alert id, notifications queued)."""
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            begin_write(session)  # as ingest does: waits for the delivery worker's writes
            alert = Alert(
                run_id=run_id,
                rule="loss_scale_collapse",
                layer=layer,
                severity=severity,
                status="firing",
                started_step=110,
                fired_step=115,
                started_at=utcnow(),
                fired_at=utcnow(),
                message="loss scale 0.25 < 1.0 at step 115",
                values={"loss_scale": 0.25, "grad_norm": "NaN"},
            )
            session.add(alert)
            session.flush()
            queued = enqueue(session, alert, transition)  # type: ignore[arg-type]
            session.commit()
            return alert.id, queued
    finally:
        engine.dispose()


def deliveries(api: httpx.Client, webhook_id: int) -> list[dict[str, Any]]:
    response = api.get(f"/webhooks/{webhook_id}/deliveries")
    assert response.status_code == 200, response.text
    return list(response.json()["deliveries"])


def wait_until_settled(api: httpx.Client, webhook_id: int, timeout: float = 10.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        log = deliveries(api, webhook_id)
        if log and all(d["status"] != "pending" for d in log):
            return log
        assert time.monotonic() < deadline, f"deliveries still pending: {log}"
        time.sleep(0.05)


def due_after_settling(database_url: str) -> int:
    """Drive one delivery round directly, a day ahead (every retry and claim lease is due
    by then), and return how many notifications it found to POST. A check that only waits
    a few of the background worker's rounds passes whether or not they ran."""
    engine = make_engine(database_url)
    worker = DeliveryWorker(
        make_sessionmaker(engine), Settings(database_url=database_url, **FAST), sweep=None
    )
    try:
        return worker.tick(utcnow() + timedelta(days=1))
    finally:
        worker.stop()
        engine.dispose()


def add_webhook(api: httpx.Client, url: str, **fields: Any) -> int:
    response = api.post("/webhooks", json={"url": url, **fields})
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


# --- the retry policy, a pure function ---------------------------------------------------


def test_retry_delay_backs_off_exponentially_and_gives_up() -> None:
    policy = {"max_attempts": 5, "base": 2.0, "cap": 10.0}
    top = [retry_delay(n, 500, rng=lambda: 1.0, **policy) for n in range(1, 6)]
    assert top == [2.0, 4.0, 8.0, 10.0, None]  # doubling, capped, given up at attempt 5
    assert retry_delay(3, 503, rng=lambda: 0.0, **policy) == 4.0  # equal jitter: half fixed
    assert retry_delay(1, None, rng=lambda: 0.5, **policy) == 1.5  # connection error: retry
    assert retry_delay(1, 429, rng=lambda: 1.0, **policy) == 2.0
    assert retry_delay(1, 404, **policy) is None  # a revoked Slack hook will not come back
    assert retry_delay(1, 400, **policy) is None
    assert [is_retryable(s) for s in (None, 408, 429, 500, 503, 301, 400, 410)] == [
        True,
        True,
        True,
        True,
        True,
        False,
        False,
        False,
    ]


def test_run_links_point_at_the_dashboard_people_open() -> None:
    mounted = Settings(database_url="sqlite://", public_url="https://aw.example/")
    assert run_page_url(mounted, 7) == "https://aw.example/dashboard/run/7"
    separate = Settings(database_url="sqlite://", dashboard_url="http://aw.example:8050/")
    assert run_page_url(separate, 7) == "http://aw.example:8050/run/7"


# --- delivery ----------------------------------------------------------------------------


def test_slack_and_generic_bodies_arrive(
    fast_collector: Any, api: httpx.Client, receiver: WebhookReceiver
) -> None:
    slack = add_webhook(api, receiver.url("/slack"), format="slack")
    generic = add_webhook(api, receiver.url("/generic"), format="generic")
    # Neither of these wants the alert: a critical-only hook (the alert is a warning) and
    # another project's hook.
    add_webhook(api, receiver.url("/critical-only"), min_severity="critical")
    add_webhook(api, receiver.url("/other"), project="other")
    run_id = ingest_run(api)
    alert_id, queued = fire_alert(fast_collector.database_url, run_id, severity="warning")
    assert queued == 2

    [body] = receiver.wait_for("/generic", 1)
    assert body["version"] == 1 and body["kind"] == "alert"
    assert body["transition"] == "firing" and body["project"] == "default"
    assert body["alert"]["id"] == alert_id
    assert body["alert"]["rule"] == "loss_scale_collapse"
    assert body["alert"]["severity"] == "warning"
    assert (body["alert"]["started_step"], body["alert"]["fired_step"]) == (110, 115)
    assert body["alert"]["values"] == {"loss_scale": 0.25, "grad_norm": "NaN"}
    run_url = f"{fast_collector.url}/dashboard/run/{run_id}"
    assert body["run"] == {
        "id": run_id,
        "client_run_id": "run-a",
        "name": "gpt-small",
        "project": "default",
        "url": run_url,
    }
    [message] = receiver.wait_for("/slack", 1)
    assert message["text"].startswith(
        "[WARNING] loss_scale_collapse firing on run gpt-small at step 115: "
        "loss scale 0.25 &lt; 1.0 at step 115"  # Slack-escaped
    )
    assert f"<{run_url}|open run>" in message["text"]
    fields = dict(f["text"].split("\n") for f in message["blocks"][1]["fields"])
    assert fields == {
        "*Run*": f"gpt-small (id {run_id})",
        "*Project*": "default",
        "*Rule*": "loss_scale_collapse",
        "*Severity*": "warning",
        "*Layer*": "(whole run)",
        "*Step*": "115",
    }
    assert run_url in message["blocks"][-1]["elements"][0]["text"]

    assert [d["status"] for d in wait_until_settled(api, slack)] == ["delivered"]
    [delivered] = wait_until_settled(api, generic)
    assert delivered["status"] == "delivered" and delivered["attempts"] == 1
    assert delivered["response_status"] == 200 and delivered["last_error"] is None
    assert delivered["delivered_at"] is not None
    assert (delivered["run_id"], delivered["rule"], delivered["transition"]) == (
        run_id,
        "loss_scale_collapse",
        "firing",
    )
    assert due_after_settling(fast_collector.database_url) == 0  # nothing left, nothing unwanted
    assert len(receiver.bodies("/generic")) == len(receiver.bodies("/slack")) == 1
    assert receiver.bodies("/critical-only") == receiver.bodies("/other") == []


def test_retries_after_500_then_succeeds(
    fast_collector: Any, api: httpx.Client, receiver: WebhookReceiver
) -> None:
    receiver.script("/flaky", [500, 503, 200])
    hook = add_webhook(api, receiver.url("/flaky"))
    fire_alert(fast_collector.database_url, ingest_run(api))
    bodies = receiver.wait_for("/flaky", 3)
    assert [body["attempt"] for body in bodies] == [1, 2, 3]
    assert len({body["notification_id"] for body in bodies}) == 1
    assert bodies[0]["alert"] == bodies[2]["alert"]
    [log] = wait_until_settled(api, hook)
    assert (log["status"], log["attempts"], log["response_status"]) == ("delivered", 3, 200)
    assert log["last_error"] is None


def test_gives_up_after_max_attempts(
    fast_collector: Any, api: httpx.Client, receiver: WebhookReceiver
) -> None:
    receiver.script("/down", [500])
    receiver.script("/gone", [410])
    down = add_webhook(api, receiver.url("/down"))
    gone = add_webhook(api, receiver.url("/gone"))
    fire_alert(fast_collector.database_url, ingest_run(api))
    [log] = wait_until_settled(api, down)
    assert (log["status"], log["attempts"], log["response_status"]) == ("failed", 3, 500)
    assert log["last_error"].startswith("HTTP 500")
    [log] = wait_until_settled(api, gone)  # a 4xx is not retried
    assert (log["status"], log["attempts"], log["response_status"]) == ("failed", 1, 410)
    assert due_after_settling(fast_collector.database_url) == 0  # no attempt after giving up
    assert len(receiver.bodies("/down")) == 3 and len(receiver.bodies("/gone")) == 1


@SQLITE_ONLY
def test_unreachable_webhook_records_the_error(fast_collector: Any, api: httpx.Client) -> None:
    hook = add_webhook(api, "http://127.0.0.1:9/nothing-listens")
    fire_alert(fast_collector.database_url, ingest_run(api))
    [log] = wait_until_settled(api, hook)
    assert (log["status"], log["attempts"], log["response_status"]) == ("failed", 3, None)
    assert "ConnectError" in log["last_error"]


def test_a_hanging_or_failing_webhook_never_slows_ingest(
    sqlite_url: str,
    start_collector: Callable[..., AbstractContextManager[Any]],
    receiver: WebhookReceiver,
) -> None:
    timeout = 2.5
    receiver.delay("/hang", timeout + 1.5)  # longer than the timeout: every POST times out
    receiver.script("/error", [500])
    settings = {**FAST, "webhook_timeout": timeout, "webhook_max_attempts": 100}
    with (
        start_collector(sqlite_url, dashboard=False, **settings) as live,
        httpx.Client(base_url=f"{live.url}/api/v1", timeout=30) as api,
    ):
        add_webhook(api, receiver.url("/hang"))
        add_webhook(api, receiver.url("/error"))
        run_id = ingest_run(api, "busy")
        for layer in range(10):
            fire_alert(live.database_url, run_id, layer=f"blocks.{layer}.fc.weight")
        receiver.wait_for("/hang", 1)  # deliveries are in flight now
        # ...and the first round's ten failures recorded: that burst of short writes is
        # SQLite's one writer at work, not ingest waiting on a webhook (a CI run under load
        # saw a first ingest of 1.19 s there, every later one under 30 ms).
        failed_before = len(receiver.wait_for("/error", 10))
        latencies: list[float] = []
        begun = time.perf_counter()
        seq = 0
        while time.perf_counter() - begun < 2 * timeout + 0.2:  # across two rounds of timeouts
            seq += 1
            steps = [step_record(seq * 100 + i, loss=1.0, loss_scale=65536.0) for i in range(100)]
            batch = make_batch(seq, client_run_id="busy", steps=steps)
            started = time.perf_counter()
            response = api.post(INGEST_PATH.removeprefix("/api/v1"), json=dict(batch))
            latencies.append(time.perf_counter() - started)
            assert response.status_code == 200
        # Each hanging POST takes the full timeout: ingest waiting on them would wait up to
        # that long, and some request of two rounds would wait nearly all of it (the bound
        # leaves room for a loaded test machine).
        assert max(latencies) < timeout - 1.0, latencies
        # The worker kept delivering meanwhile: POSTs that hung for their full timeout,
        # and retries of the failing hook between them.
        assert len(receiver.bodies("/hang")) >= 8
        assert len(receiver.bodies("/error")) > failed_before


@SQLITE_ONLY
def test_webhook_test_endpoint_posts_at_once(api: httpx.Client, receiver: WebhookReceiver) -> None:
    hook = add_webhook(api, receiver.url("/t"), format="slack")
    answer = api.post(f"/webhooks/{hook}/test").json()
    assert answer == {"delivered": True, "response_status": 200, "error": None}
    [body] = receiver.bodies("/t")
    assert body["text"].startswith("[INFO] test firing on run (test)")
    receiver.script("/t", [500])
    answer = api.post(f"/webhooks/{hook}/test").json()
    assert (answer["delivered"], answer["response_status"]) == (False, 500)


def test_deleting_a_webhook_drops_its_queue(
    fast_collector: Any, api: httpx.Client, receiver: WebhookReceiver
) -> None:
    receiver.script("/down", [500])
    hook = add_webhook(api, receiver.url("/down"))
    fire_alert(fast_collector.database_url, ingest_run(api))
    receiver.wait_for("/down", 1)
    assert api.delete(f"/webhooks/{hook}").status_code == 204
    assert api.get(f"/webhooks/{hook}/deliveries").status_code == 404
    engine = make_engine(fast_collector.database_url)
    try:
        with engine.connect() as connection:
            assert connection.scalars(select(Notification.id)).all() == []
            assert connection.scalar(select(Run.id)) is not None
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_two_workers_deliver_each_notification_once(
    postgres_url: str, receiver: WebhookReceiver
) -> None:
    """Two collector workers on one PostgreSQL: SKIP LOCKED claims are disjoint."""
    upgrade(postgres_url)
    engine = make_engine(postgres_url)
    sessions = make_sessionmaker(engine)
    settings = Settings(database_url=postgres_url, **FAST)
    with sessions() as session:
        ensure_project(session, "default")
        run = Run(client_run_id="shared", name="shared", project="default")
        session.add_all([run, Webhook(url=receiver.url("/once"), format="generic")])
        session.flush()
        for layer in range(60):
            alert = Alert(
                run_id=run.id,
                rule="silent_underflow",
                layer=f"blocks.{layer}",
                severity="critical",
                status="firing",
                started_step=1,
                fired_step=2,
            )
            session.add(alert)
            session.flush()
            enqueue(session, alert, "firing")
        session.commit()
    receiver.delay("/once", 0.01)
    workers = [DeliveryWorker(sessions, settings, sweep=None) for _ in range(2)]
    try:
        # Rows another transaction holds are skipped at once, not waited for.
        with sessions() as holder:
            held = holder.scalars(
                select(Notification.id).order_by(Notification.id).limit(10).with_for_update()
            ).all()
            claimed: list[Any] = []
            # In a thread: a claim that waited for the held rows would never return here.
            claimer = threading.Thread(
                target=lambda: claimed.extend(workers[0].claim(utcnow(), limit=20))
            )
            claimer.start()
            claimer.join(timeout=5)
            holder.rollback()
            claimer.join()
            assert len(claimed) == 20, "the claim waited for rows another worker holds"
            claims = claimed
            assert not {c.id for c in claims} & set(held)
        with http_client(settings) as client:
            workers[0].record(claims, [post(client, c.url, c.body) for c in claims])

        def drain(worker: DeliveryWorker) -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if worker.tick() == 0:
                    with sessions() as session:
                        left = session.scalar(
                            select(func.count()).where(Notification.status == "pending")
                        )
                    if not left:
                        return

        threads = [threading.Thread(target=drain, args=(w,)) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        delivered = Counter(body["notification_id"] for body in receiver.bodies("/once"))
        assert len(delivered) == 60 and set(delivered.values()) == {1}
        with sessions() as session:
            assert session.scalars(select(Notification.status).distinct()).all() == ["delivered"]
    finally:
        for worker in workers:
            worker.stop()
        engine.dispose()


def test_worker_runs_the_alert_sweep_and_survives_its_failures(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from ampwatch.server import alerts

    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    sessions = make_sessionmaker(engine)
    settings = Settings(database_url=sqlite_url, **FAST)
    calls: list[Any] = []

    def failing_sweep(session: Any, now: Any) -> None:
        calls.append(now)
        raise RuntimeError("sweep broke")

    worker = DeliveryWorker(sessions, settings, sweep=failing_sweep)
    default = DeliveryWorker(sessions, settings)
    try:
        assert worker.tick() == 0 and worker.tick() == 0  # delivery still runs
        assert len(calls) == 2
        logged = [r for r in caplog.records if "sweep failed" in r.getMessage()]
        assert len(logged) == 1  # once until it works again, not every second
        assert default._sweep is alerts.sweep  # the engine's no_data sweep, when installed
        assert default.tick() == 0
    finally:
        worker.stop()
        default.stop()
        engine.dispose()


def test_wakes_deliver_at_once_and_the_sweep_keeps_its_interval(sqlite_url: str) -> None:
    """Batches that queue notifications wake the worker many times a second: each wake is
    a delivery round, but the sweep (no_data: it judges time, which a wake does not move)
    runs once per `notify_interval` of the worker's clock, driven here by hand."""
    import queue

    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    clock = [1000.0]
    swept: list[Any] = []
    rounds: queue.Queue[bool] = queue.Queue()

    class Observed(DeliveryWorker):
        def tick(self, now: Any = None, *, sweep: bool = True) -> int:
            tried = super().tick(now, sweep=sweep)
            rounds.put(sweep)
            return tried

    settings = Settings(database_url=sqlite_url, notify_interval=3600.0)
    worker = Observed(make_sessionmaker(engine), settings,
                      sweep=lambda session, now: swept.append(now), clock=lambda: clock[0])  # fmt: skip

    def wake() -> bool:
        worker.wake()
        return rounds.get(timeout=30)

    worker.start()
    try:
        assert wake() is True  # the first round sweeps
        assert [wake() for _ in range(5)] == [False] * 5  # the clock has not moved
        clock[0] += 3599.0
        assert wake() is False
        clock[0] += 1.0  # an interval since the first sweep
        assert wake() is True
        assert wake() is False
        assert len(swept) == 2
    finally:
        worker.stop()
        engine.dispose()


def test_one_alerts_transitions_arrive_in_order(
    fast_collector: Any, api: httpx.Client, receiver: WebhookReceiver
) -> None:
    receiver.script("/ordered", [500, 500, 200])
    hook = add_webhook(api, receiver.url("/ordered"))
    alert_id, _ = fire_alert(fast_collector.database_url, ingest_run(api))
    engine = make_engine(fast_collector.database_url)
    try:
        with make_sessionmaker(engine)() as session:  # resolved while firing is retried
            # A writer from the start: read first, then written, SQLite refused the write
            # at once ("database is locked") while the worker recorded a retry.
            begin_write(session)
            alert = session.get(Alert, alert_id)
            assert alert is not None
            alert.status, alert.resolved_step = "resolved", 130
            enqueue(session, alert, "resolved")
            session.commit()
    finally:
        engine.dispose()
    bodies = receiver.wait_for("/ordered", 4)
    assert [(b["transition"], b["attempt"]) for b in bodies] == [
        ("firing", 1),
        ("firing", 2),
        ("firing", 3),
        ("resolved", 1),
    ]
    log = wait_until_settled(api, hook)
    assert [(d["transition"], d["status"]) for d in log] == [
        ("resolved", "delivered"),
        ("firing", "delivered"),
    ]
