"""Alert notifications' delivery: a worker thread in each ingest process (`DeliveryWorker`,
started by `ingest_worker.start`) that POSTs what the outbox (`ampwatch.server.outbox`)
queued: its writes take turns with the batches' there, and the batch that queued a
notification wakes it.

Delivery happens later, from the worker, so a slow or failing webhook never slows ingest.
Each round the worker (1) runs the alert engine's periodic sweep
(`ampwatch.server.alerts.sweep`, the no_data rule) when `settings.notify_interval` has
passed since the last one, then (2) claims due notifications and POSTs them, several at a
time, with bodies from `ampwatch.server.webhook_formats`.

Claiming is a short transaction that moves the row's `next_attempt_at` one lease ahead and
counts the attempt; the POST happens after it commits, and a second short transaction
records the outcome. No transaction stays open across HTTP, which on SQLite (one writer)
would stall ingest for as long as a webhook hangs. On PostgreSQL the claim reads with
`FOR UPDATE SKIP LOCKED`, so collector workers sharing the database claim disjoint rows
without waiting for each other; a worker that dies mid-POST leaves its claim to expire
(`lease`) and another worker retries it.

>>> worker = DeliveryWorker(sessions, settings).start()  # doctest: +SKIP
>>> worker.stop()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import httpx
from sqlalchemy import exists, select, update
from sqlalchemy.orm import Session, aliased, sessionmaker

from ampwatch.agent.retry import retry_delay
from ampwatch.server.alerts import sweep as alert_sweep
from ampwatch.server.db import begin_write
from ampwatch.server.models import Alert, Notification, Run, Webhook, utcnow
from ampwatch.server.settings import Settings
from ampwatch.server.webhook_client import read_capped, webhook_client
from ampwatch.server.webhook_formats import alert_message, render, sample_message

logger = logging.getLogger(__name__)

#: Longest wait between two attempts of one notification, whatever the attempt number.
RETRY_CAP_SECONDS = 15 * 60.0

#: Notifications claimed per worker round, and POSTs in flight at once.
CLAIM_BATCH = 32
PARALLEL_POSTS = 8


@dataclass(frozen=True)
class Outcome:
    """How one POST ended: `status` None when no HTTP answer came (error says why)."""

    status: int | None
    error: str | None

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> Outcome:
    """POST `body` as JSON to `url` through `client` (`http_client`); never raises for
    network trouble, and reads at most `webhook_client.MAX_RESPONSE_BYTES` of the answer."""
    try:
        with client.stream("POST", url, json=body) as response:
            status = response.status_code
            if 200 <= status < 300:
                return Outcome(status, None)
            text = read_capped(response).decode(errors="replace")
    except httpx.HTTPError as error:
        return Outcome(None, f"{type(error).__name__}: {error}"[:500] or type(error).__name__)
    return Outcome(status, f"HTTP {status}: {text[:300]}")


def http_client(settings: Settings) -> httpx.Client:
    """The client deliveries go through (`ampwatch.server.webhook_client`): addresses
    checked at connect time against `settings.webhook_allowed_networks`, no redirects, one
    total time limit of `settings.webhook_timeout` per delivery."""
    return webhook_client(
        timeout=settings.webhook_timeout, allowed=settings.webhook_allowed_networks
    )


def send_test(webhook: Webhook, settings: Settings) -> Outcome:
    """POST a test message to `webhook` now (not through the outbox: it announces no
    alert, and the caller wants the answer)."""
    with http_client(settings) as client:
        return post(client, webhook.url, render(sample_message(webhook), webhook.format))


@dataclass(frozen=True)
class _Claim:
    id: int
    attempts: int
    url: str
    body: dict[str, Any]


class DeliveryWorker:
    """One daemon thread per ingest process: each `settings.notify_interval`, or at once
    when woken (`wake`), it delivers due notifications, after the alert sweep when one is
    due (`tick`). `stop()` waits for the round in progress, which is bounded by the
    webhook timeout.

    The sweep keeps its interval however often batches wake the worker: it judges time
    (no_data's silence), which a wake does not move. Under `bench/load.py`'s 32 agents the
    wakes came ~10 times a second, and a sweep each time (two queries) was ~5% of the
    ingest process's CPU, beside the batches it shares the process with.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        settings: Settings,
        *,
        sweep: Callable[[Session, datetime], Any] | Literal["auto"] | None = "auto",
        rng: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessions = sessions
        self._settings = settings
        self._sweep = alert_sweep if sweep == "auto" else sweep
        self._rng = rng
        self._clock = clock
        self._swept_at: float | None = None  # `clock` at the last round's sweep
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = http_client(settings)
        self._pool = ThreadPoolExecutor(PARALLEL_POSTS, thread_name_prefix="ampwatch-webhook")
        self._failing: set[str] = set()
        # A claim outlives any single POST (bounded in total by webhook_timeout), with
        # room for the round's other POSTs, before another worker may take it over.
        self.lease = timedelta(seconds=4 * settings.webhook_timeout + 30)

    def start(self) -> DeliveryWorker:
        self._thread = threading.Thread(target=self._loop, name="ampwatch-notify", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current round (idempotent); waits up to `timeout` seconds."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            bound = 3 * self._settings.webhook_timeout if timeout is None else timeout
            self._thread.join(bound)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def wake(self) -> None:
        """Start a round now rather than at the next interval: ingest calls it when a batch
        queued a notification, so an alert's delivery waits for no timer (up to a second,
        by default, before)."""
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self._settings.notify_interval)
            self._wake.clear()  # before the round: a wake during it starts the next one
            if self._stop.is_set():
                return
            self.tick(sweep=self.sweep_due())

    def sweep_due(self) -> bool:
        """Whether `settings.notify_interval` has passed (by `clock`) since the last sweep,
        or none ran yet."""
        swept = self._swept_at
        return swept is None or self._clock() - swept >= self._settings.notify_interval

    def tick(self, now: datetime | None = None, *, sweep: bool = True) -> int:
        """One round: the sweep (unless `sweep` is false), then delivery of what is due;
        returns the notifications tried. Errors are logged (once until the step works
        again) and never end the worker."""
        now = now or utcnow()
        if sweep and self._sweep is not None:
            self._swept_at = self._clock()
            self._guard("sweep", self._run_sweep, now)
        return self._guard("deliver", self._deliver_due, now) or 0

    def _guard(self, step: str, function: Callable[[datetime], Any], now: datetime) -> Any:
        try:
            result = function(now)
        except Exception:
            if step not in self._failing:
                self._failing.add(step)
                logger.exception("notification worker: %s failed; retrying every round", step)
            return None
        if step in self._failing:
            self._failing.discard(step)
            logger.warning("notification worker: %s works again", step)
        return result

    def _run_sweep(self, now: datetime) -> None:
        assert self._sweep is not None
        with self._sessions() as session:
            # The sweep reads first and opens its own short write transaction per run it
            # changes, so a round with nothing stale takes no write lock.
            self._sweep(session, now)
            session.commit()

    def _deliver_due(self, now: datetime) -> int:
        claims = self.claim(now)
        if claims:
            outcomes = list(self._pool.map(lambda c: post(self._client, c.url, c.body), claims))
            self.record(claims, outcomes)
        return len(claims)

    def claim(self, now: datetime, limit: int = CLAIM_BATCH) -> list[_Claim]:
        """Claim up to `limit` due notifications for this worker and build their bodies."""
        earlier = aliased(Notification)
        due = (
            Notification.status == "pending",
            Notification.next_attempt_at <= now,
            # One alert's transitions reach a webhook in order: a "resolved" waits while
            # the "firing" before it is still being retried.
            ~exists().where(
                earlier.alert_id == Notification.alert_id,
                earlier.webhook_id == Notification.webhook_id,
                earlier.status == "pending",
                earlier.id < Notification.id,
            ),
        )
        with self._sessions() as session:
            # A read first: a round with nothing due takes no write lock (SQLite).
            if session.scalar(select(Notification.id).where(*due).limit(1)) is None:
                return []
            session.rollback()
            begin_write(session)
            ids = session.scalars(
                select(Notification.id)
                .where(*due)
                .order_by(Notification.next_attempt_at, Notification.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            ).all()
            if not ids:
                return []
            session.execute(
                update(Notification)
                .where(Notification.id.in_(ids))
                .values(attempts=Notification.attempts + 1, next_attempt_at=now + self.lease)
            )
            rows = session.execute(
                select(Notification, Alert, Run, Webhook)
                .join(Alert, Alert.id == Notification.alert_id)
                .join(Run, Run.id == Alert.run_id)
                .join(Webhook, Webhook.id == Notification.webhook_id)
                .where(Notification.id.in_(ids))
                .order_by(Notification.id)
            ).all()
            claims = [
                _Claim(
                    id=note.id,
                    attempts=note.attempts,
                    url=hook.url,
                    body=render(
                        alert_message(
                            note.id,
                            note.transition,
                            alert,
                            run,
                            self._settings,
                            attempt=note.attempts,
                        ),
                        hook.format,
                    ),
                )
                for note, alert, run, hook in rows
            ]
            session.commit()
        return claims

    def record(self, claims: list[_Claim], outcomes: list[Outcome]) -> None:
        """Store each attempt's outcome: delivered, retried later, or failed for good."""
        now = utcnow()
        with self._sessions() as session:
            begin_write(session)
            for claim, outcome in zip(claims, outcomes):
                values: dict[str, Any] = {
                    "response_status": outcome.status,
                    "last_error": outcome.error,
                }
                if outcome.delivered:
                    values.update(status="delivered", delivered_at=now)
                else:
                    delay = retry_delay(
                        claim.attempts,
                        outcome.status,
                        base=self._settings.webhook_retry_base,
                        cap=RETRY_CAP_SECONDS,
                        max_attempts=self._settings.webhook_max_attempts,
                        rng=self._rng,
                    )
                    if delay is None:
                        values.update(status="failed")
                    else:
                        values.update(next_attempt_at=now + timedelta(seconds=delay))
                # Only while the claim is ours: a claim that outlived its lease was taken
                # over, and the newer attempt's outcome wins.
                session.execute(
                    update(Notification)
                    .where(
                        Notification.id == claim.id,
                        Notification.attempts == claim.attempts,
                        Notification.status == "pending",
                    )
                    .values(**values)
                )
            session.commit()
