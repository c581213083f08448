"""The background sender: one daemon thread between the training thread and the collector.

The training thread only calls `Sender.put` (a `put_nowait`; on a full queue the sample is
dropped and counted). The sender thread waits for each sample's device-to-host copy, turns
it into wire records, buffers them (bounded: oldest layer statistics are dropped first),
and sends gzip JSON batches with retries. A batch keeps its `seq` across retries and the
collector drops duplicates, so a retry never double-counts; `seq` advances only when a
batch is acknowledged, so the collector sees no gaps even after it rejected one.

The owner (`WatchHandle`) closes the sender at detach and from an `atexit` hook, so a run
that ends without `detach()` still flushes, for a bounded time.
"""

from __future__ import annotations

import gzip
import json
import logging
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from ampwatch.agent import wire
from ampwatch.agent.records import LayerSample, StepSample, layer_record, step_record

logger = logging.getLogger("ampwatch.agent")

#: (gzip JSON body, headers) -> HTTP status; raising means "not delivered, retry".
Transport = Callable[[bytes, dict[str, str]], int]

HEADERS = {"Content-Type": "application/json", "Content-Encoding": "gzip"}


def retry_delay(
    attempt: int,
    status: int | None,
    *,
    base: float = 0.5,
    cap: float = 30.0,
    rng: Callable[[], float] = random.random,
) -> float | None:
    """Seconds to wait before retry number `attempt` (1, 2, ...), or None to give up.

    `status` is the HTTP status, or None for a connection error or timeout. Retried: None,
    429 and 5xx, forever (the buffer bounds memory; a collector outage must not end the
    run's reporting). Given up: any other status (a 4xx will fail the same way again).
    Delay: exponential, capped, with "equal jitter" (half fixed, half random) so that many
    ranks restarting together spread out but never retry in a tight loop.

    >>> retry_delay(3, 503, base=1.0, cap=30.0, rng=lambda: 0.0)
    2.0
    """
    if status is not None and status != 429 and status < 500:
        return None
    ceiling = min(cap, base * 2.0 ** (attempt - 1))
    return ceiling / 2 + rng() * ceiling / 2


def http_transport(url: str, *, timeout: float = 10.0) -> Transport:
    """POST to `url` + `wire.INGEST_PATH` with the standard library; returns the status."""
    endpoint = url.rstrip("/") + wire.INGEST_PATH

    def post(body: bytes, headers: dict[str, str]) -> int:
        request = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read()
                return int(response.status)
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code

    return post


@dataclass
class _InFlight:
    body: bytes
    records: dict[str, int]  # records per kind in this batch
    drops: dict[str, int]  # the batch's "dropped" field
    attempt: int = 0
    next_try: float = 0.0


@dataclass
class _Buffer:
    steps: deque[wire.StepRecord] = field(default_factory=deque)
    layer_stats: deque[wire.LayerStatsRecord] = field(default_factory=deque)
    events: deque[wire.EventRecord] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self.steps) + len(self.layer_stats) + len(self.events)


_KINDS = ("steps", "layer_stats", "events")
#: Under memory pressure: per-layer statistics first, the alerting per-step series next.
_DROP_ORDER = ("layer_stats", "steps", "events")


class Sender:
    """Owns the sender thread. `put` from the training thread; `close(timeout)` at the end.

    Bounds: the queue holds `max_queue` samples; the record buffer `max_buffered` records,
    of which at most `max_buffered_layer_stats` layer-statistic records (the bulky ones).
    """

    def __init__(
        self,
        run: wire.RunRef,
        transport: Transport,
        *,
        flush_interval: float = 1.0,
        max_queue: int = 10_000,
        max_batch_records: int = 2_000,
        max_buffered: int = 10_000,
        max_buffered_layer_stats: int = 100,
        retry_base: float = 0.5,
        retry_cap: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._run = run
        self._transport = transport
        self._flush_interval = flush_interval
        self._max_batch_records = max_batch_records
        self._max_buffered = max_buffered
        self._max_buffered_layer_stats = max_buffered_layer_stats
        self._retry_base = retry_base
        self._retry_cap = retry_cap
        self._clock = clock
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._wake = threading.Event()
        self._wake_at = max(1, max_queue // 4)
        self._buffer = _Buffer()
        self._inflight: _InFlight | None = None
        self._seq = 0
        self._lock = threading.Lock()
        self._dropped = dict.fromkeys(_KINDS, 0)  # total, for counters
        self._unreported = dict.fromkeys(_KINDS, 0)  # not yet in a batch's "dropped"
        self._counters = {"batches_sent": 0, "send_failures": 0, "batches_rejected": 0}
        self._unsent_at_close = 0
        self._deadline: float | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._run_thread, name="ampwatch-sender", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def put(self, item: StepSample | LayerSample | wire.EventRecord) -> None:
        """Hand a sample to the sender; never blocks, never raises. Full queue: drop, count."""
        if self._closed:
            return
        try:
            self._queue.put_nowait(item)
            if self._queue.qsize() >= self._wake_at:
                self._wake.set()
        except queue.Full:
            kind = (
                "steps"
                if isinstance(item, StepSample)
                else ("layer_stats" if isinstance(item, LayerSample) else "events")
            )
            self._count_drop(kind)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {
                **self._counters,
                **{f"dropped_{kind}": n for kind, n in self._dropped.items()},
                "unsent_at_close": self._unsent_at_close,
            }

    @staticmethod
    def idle_counters() -> dict[str, int]:
        """The counters of a sender that never ran (a disabled agent): same keys, all 0."""
        names = ["batches_sent", "send_failures", "batches_rejected", "unsent_at_close"]
        return dict.fromkeys(names + [f"dropped_{kind}" for kind in _KINDS], 0)

    def close(self, timeout: float = 5.0) -> bool:
        """Flush what is queued, trying for at most `timeout` seconds; True if all was sent."""
        if self._closed:
            with self._lock:
                return self._unsent_at_close == 0
        # The thread stops sending a little before `timeout` so it can count what is unsent.
        self._deadline = self._clock() + 0.9 * timeout
        self._closed = True
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if self._thread.is_alive() or self._thread.ident is None:
            # Stuck in a transport call (or never started): count what it still holds.
            inflight = self._inflight
            with self._lock:
                self._unsent_at_close = (
                    self._queue.qsize()
                    + len(self._buffer)
                    + (sum(inflight.records.values()) if inflight is not None else 0)
                )
        with self._lock:
            return self._unsent_at_close == 0

    # --- sender thread -------------------------------------------------------------------

    def _run_thread(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug here must not take the training process with it
            logger.exception("ampwatch sender stopped; no more data will be sent")

    def _loop(self) -> None:
        """Wake once per flush interval, when a retry is due, when the queue is a quarter
        full, or at close; not once per sample: a thread switch per training step would
        cost the training thread more than the agent's own work does."""
        next_flush = self._clock() + self._flush_interval
        while not self._closed:
            wake = next_flush
            if self._inflight is not None:
                wake = min(wake, self._inflight.next_try)
            self._wake.wait(max(0.0, wake - self._clock()))
            self._wake.clear()
            self._absorb_queued()
            now = self._clock()
            if now >= next_flush or len(self._buffer) >= self._max_batch_records:
                next_flush = now + self._flush_interval
                self._send_due(now)
            elif self._inflight is not None and now >= self._inflight.next_try:
                self._send_due(now)
        self._finish()

    def _absorb_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._absorb(item)

    def _finish(self) -> None:
        """At close: send what is left until it is gone or the deadline passes."""
        assert self._deadline is not None
        self._absorb_queued()
        while (self._inflight is not None or len(self._buffer)) and self._clock() < self._deadline:
            self._send_due(self._clock())
            if self._inflight is not None:
                time.sleep(max(0.0, min(self._inflight.next_try, self._deadline) - self._clock()))
        with self._lock:
            self._unsent_at_close = len(self._buffer) + (
                sum(self._inflight.records.values()) if self._inflight else 0
            )

    def _absorb(self, item: object) -> None:
        if isinstance(item, StepSample):
            self._buffer.steps.append(step_record(item))
        elif isinstance(item, LayerSample):
            self._buffer.layer_stats.append(layer_record(item))
            if len(self._buffer.layer_stats) > self._max_buffered_layer_stats:
                self._buffer.layer_stats.popleft()
                self._count_drop("layer_stats")
        else:
            self._buffer.events.append(cast(wire.EventRecord, item))
        while len(self._buffer) > self._max_buffered:
            for kind in _DROP_ORDER:
                records: deque[Any] = getattr(self._buffer, kind)
                if records:
                    records.popleft()
                    self._count_drop(kind)
                    break

    def _count_drop(self, kind: str) -> None:
        with self._lock:
            self._dropped[kind] += 1
            self._unreported[kind] += 1

    def _send_due(self, now: float) -> None:
        """Send batches until the buffer is empty or a send fails (retried when due)."""
        while True:
            if self._inflight is None:
                if not len(self._buffer):
                    return
                self._inflight = self._seal()
            elif now < self._inflight.next_try:
                return
            if not self._attempt(self._inflight, now):
                return

    def _attempt(self, inflight: _InFlight, now: float) -> bool:
        """One try; True if the batch left the in-flight slot (acknowledged or rejected)."""
        inflight.attempt += 1
        try:
            status: int | None = self._transport(inflight.body, dict(HEADERS))
        except Exception as exc:
            status = None
            if self._counters["send_failures"] == 0:
                logger.warning("ampwatch: sending a batch failed (%r); will retry", exc)
        if status is not None and 200 <= status < 300:
            with self._lock:
                self._counters["batches_sent"] += 1
            self._seq += 1
            self._inflight = None
            return True
        with self._lock:
            self._counters["send_failures"] += 1
        delay = retry_delay(inflight.attempt, status, base=self._retry_base, cap=self._retry_cap)
        if delay is not None:
            inflight.next_try = now + delay
            return False
        logger.warning("ampwatch: the collector rejected a batch (HTTP %s); dropped", status)
        with self._lock:
            self._counters["batches_rejected"] += 1
            for kind in _KINDS:
                self._dropped[kind] += inflight.records[kind]
                self._unreported[kind] += inflight.records[kind] + inflight.drops[kind]
        self._inflight = None  # its seq is reused: the collector stored nothing
        return True

    def _seal(self) -> _InFlight:
        budget = self._max_batch_records
        taken: dict[str, list[Any]] = {}
        for kind in ("events", "steps", "layer_stats"):
            records: deque[Any] = getattr(self._buffer, kind)
            n = min(budget, len(records))
            taken[kind] = [records.popleft() for _ in range(n)]
            budget -= n
        with self._lock:
            dropped = dict(self._unreported)
            self._unreported = dict.fromkeys(_KINDS, 0)
        batch: wire.Batch = {
            "wire_version": wire.WIRE_VERSION,
            "run": self._run,
            "seq": self._seq,
            "steps": taken["steps"],
            "layer_stats": taken["layer_stats"],
            "events": taken["events"],
            "dropped": dropped,
        }
        # default=str: an odd object in event data (a Path, a dtype) must not stop the sender
        text = json.dumps(batch, allow_nan=False, default=str)
        body = gzip.compress(text.encode(), compresslevel=5)
        return _InFlight(
            body=body, records={kind: len(taken[kind]) for kind in _KINDS}, drops=dropped
        )
