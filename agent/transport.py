"""The background sender: one daemon thread between the training thread and the collector.

The training thread only calls `Sender.put` (never blocks: on a full queue the oldest
sampled layer statistics make room, then, for an event, the oldest step; a step that finds
no room is dropped and counted). The sender thread waits for each sample's device-to-host
copy, turns it into wire records, buffers them (bounded: oldest layer statistics are
dropped first), and seals gzip JSON batches, each with this sender's `stream` id and the
next `seq`, which it keeps for good: retries, the spool and `ampwatch upload` all resend
the same (run, stream, seq), and the collector acknowledges a batch it already stored as a
duplicate, so delivery is exactly once. The stream is a fresh uuid4 per sender: the ranks
of a distributed run and a run resumed under the same run id each number seq from 0, and
must not collide.

A batch is retried in memory `spool_after` times; after that the collector counts as down:
the batch and everything sealed after it go to the on-disk spool (`ampwatch.agent.spool`),
which is replayed oldest first, one probe per backoff delay, when the collector answers
again. Offline mode writes sealed batches only to a file, for `ampwatch upload`.

The owner (`WatchHandle`) closes the sender at detach and from an `atexit` hook, so a run
that ends without `detach()` still flushes, for a bounded time; what is still unsent then
stays in the spool, on disk, for `ampwatch upload`.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampwatch.agent import wire
from ampwatch.agent.fp8 import Fp8Sample
from ampwatch.agent.records import LayerSample, StepSample, layer_record, step_record
from ampwatch.agent.spool import Frame, Spool, default_spool_dir, encode_frame

logger = logging.getLogger("ampwatch.agent")

#: (gzip JSON body, headers) -> HTTP status; raising means "not delivered, retry".
Transport = Callable[[bytes, dict[str, str]], int]

HEADERS = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
#: Default spool bound: hours of step scalars for a large model; layer statistics go first.
DEFAULT_SPOOL_MAX_BYTES = 128 * 1024 * 1024


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


def request_headers(token: str | None) -> dict[str, str]:
    """Headers of every ingest POST; a token is sent as `Authorization: Bearer <token>`."""
    return {**HEADERS, "Authorization": f"Bearer {token}"} if token else dict(HEADERS)


def post(url: str, body: bytes, headers: dict[str, str], *, timeout: float) -> tuple[int, bytes]:
    """POST `body` to `url` with the standard library: (status, response body), any status."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def http_transport(url: str, *, timeout: float = 10.0) -> Transport:
    """POST to `url` + `wire.INGEST_PATH`; returns the status, raises on connection errors."""
    endpoint = url.rstrip("/") + wire.INGEST_PATH

    def send(body: bytes, headers: dict[str, str]) -> int:
        return post(endpoint, body, headers, timeout=timeout)[0]

    return send


@dataclass
class _Buffer:
    steps: deque[wire.StepRecord] = field(default_factory=deque)
    layer_stats: deque[wire.LayerStatsRecord] = field(default_factory=deque)
    events: deque[wire.EventRecord] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self.steps) + len(self.layer_stats) + len(self.events)


_KINDS = wire.DROPPED_KINDS
_COUNTERS = (
    "batches_sent",
    "send_failures",
    "batches_rejected",
    "auth_failures",
    "batches_spooled",
    "spooled_at_close",
)
#: Under memory pressure: per-layer statistics first, the alerting per-step series next.
_DROP_ORDER = ("layer_stats", "steps", "events")


def _kind(item: StepSample | LayerSample | Fp8Sample | wire.EventRecord) -> str:
    if isinstance(item, StepSample):
        return "steps"
    return "layer_stats" if isinstance(item, (LayerSample, Fp8Sample)) else "events"


class Sender:
    """Owns the sender thread. `put` from the training thread; `close(timeout)` at the end.

    Bounds: the queue holds `max_queue` samples; the record buffer `max_buffered` records,
    of which at most `max_buffered_layer_stats` layer-statistic records (the bulky ones);
    the spool `spool_max_bytes` on disk (its memory: a few numbers per spooled batch).

    Delivery: `transport` (stdlib HTTP in `watch()`), with `token` as a bearer token; a
    batch still failing after `spool_after` tries goes to the spool in `spool_dir` (default
    `default_spool_dir(run)`; created only when first needed; `spool=False`: memory only).
    `offline_file`: append sealed batches to that file instead and never use the network.
    """

    def __init__(
        self,
        run: wire.RunRef,
        transport: Transport | None,
        *,
        token: str | None = None,
        offline_file: str | os.PathLike[str] | None = None,
        spool: bool = True,
        spool_dir: str | os.PathLike[str] | None = None,
        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
        spool_after: int = 3,
        flush_interval: float = 1.0,
        max_queue: int = 10_000,
        max_batch_records: int = 2_000,
        max_buffered: int = 10_000,
        max_buffered_layer_stats: int = 100,
        retry_base: float = 0.5,
        retry_cap: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if transport is None and offline_file is None:
            raise ValueError("pass a transport, or offline_file to write batches to a file")
        if spool_after < 1 or spool_max_bytes < 1:
            raise ValueError("spool_after and spool_max_bytes must be >= 1")
        self._run = run
        self._transport = transport
        self._headers = request_headers(token)
        self._offline = Path(offline_file) if offline_file is not None else None
        self._spool: Spool | None = None
        if spool and self._offline is None:
            directory = Path(spool_dir) if spool_dir else default_spool_dir(run["client_run_id"])
            self._spool = Spool(directory, max_bytes=spool_max_bytes)
        self._spool_after = spool_after
        self._flush_interval = flush_interval
        self._max_queue = max_queue
        self._max_batch_records = max_batch_records
        self._max_buffered = max_buffered
        self._max_buffered_layer_stats = max_buffered_layer_stats
        self._retry_base = retry_base
        self._retry_cap = retry_cap
        self._clock = clock
        # Two deques under one lock rather than a queue.Queue: a full queue must be able to
        # evict its oldest layer sample, which a Queue cannot do.
        self._queued: deque[StepSample | wire.EventRecord] = deque()
        self._queued_layers: deque[LayerSample | Fp8Sample] = deque()
        self._wake = threading.Event()
        self._wake_at = max(1, max_queue // 4)
        self._buffer = _Buffer()
        self._inflight: Frame | None = None  # the oldest batch when the spool is empty
        self._failures = 0  # consecutive failed tries of the oldest batch
        self._retry_at = 0.0
        self._stream = uuid.uuid4().hex
        self._seq = 0
        self._lock = threading.Lock()
        self._dropped = dict.fromkeys(_KINDS, 0)  # total, for counters
        self._unreported = dict.fromkeys(_KINDS, 0)  # not yet in a batch's "dropped"
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._unsent_at_close = 0
        self._logged: set[str] = set()
        self._deadline: float | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._run_thread, name="ampwatch-sender", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def put(self, item: StepSample | LayerSample | Fp8Sample | wire.EventRecord) -> None:
        """Hand a sample to the sender; never blocks, never raises. When the queue is full
        the oldest queued layer sample makes room (for an event: else the oldest step);
        failing that, `item` is dropped."""
        if self._closed:
            return
        with self._lock:
            queued = len(self._queued) + len(self._queued_layers)
            if queued >= self._max_queue:
                evicted = "layer_stats" if self._queued_layers else None
                if evicted:
                    self._queued_layers.popleft()
                elif _kind(item) == "events":
                    # Events are rare and say what steps cannot (run end, checkpoints for
                    # the restart advisor): the oldest queued step makes room for one.
                    oldest = next(
                        (i for i, q in enumerate(self._queued) if isinstance(q, StepSample)), None
                    )
                    if oldest is not None:
                        del self._queued[oldest]
                        evicted = "steps"
                if evicted is None:
                    kind = _kind(item)
                    self._dropped[kind] += 1
                    self._unreported[kind] += 1
                    return
                self._dropped[evicted] += 1
                self._unreported[evicted] += 1
                queued -= 1
            if isinstance(item, (LayerSample, Fp8Sample)):
                self._queued_layers.append(item)
            else:
                self._queued.append(item)
        if queued + 1 >= self._wake_at:
            self._wake.set()

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
        names = [*_COUNTERS, "unsent_at_close"]
        return dict.fromkeys(names + [f"dropped_{kind}" for kind in _KINDS], 0)

    def close(self, timeout: float = 5.0) -> bool:
        """Flush for at most `timeout` seconds; True if everything reached the collector
        (or the offline file). What is left is spooled (`spooled_at_close` batches) or, if
        it could not be, counted in `unsent_at_close` records."""
        if self._closed:
            with self._lock:
                return self._unsent_at_close == 0 and self._counters["spooled_at_close"] == 0
        # The thread stops sending a little before `timeout`, to spool and count what is left.
        self._deadline = self._clock() + 0.8 * timeout
        self._closed = True
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if self._thread.is_alive() or self._thread.ident is None:
            # Stuck in a transport call (or never started): count what it still holds.
            inflight = self._inflight
            with self._lock:
                self._unsent_at_close = (
                    len(self._queued)
                    + len(self._queued_layers)
                    + len(self._buffer)
                    + (sum(inflight.records.values()) if inflight is not None else 0)
                )
        with self._lock:
            return self._unsent_at_close == 0 and self._counters["spooled_at_close"] == 0

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
            if self._pending():
                wake = min(wake, self._retry_at)
            self._wake.wait(max(0.0, wake - self._clock()))
            self._wake.clear()
            self._absorb_queued()
            now = self._clock()
            seal = now >= next_flush or len(self._buffer) >= self._max_batch_records
            if seal:
                next_flush = now + self._flush_interval
            self._pump(now, seal=seal)
        self._finish()

    def _finish(self) -> None:
        """At close: deliver until done or the deadline; then spool what is left."""
        assert self._deadline is not None
        self._absorb_queued()
        if self._offline is not None:
            self._pump(self._clock(), seal=True)
        elif self._spool:
            self._retry_at = 0.0  # one try now: the collector may be back
        while (
            self._offline is None
            and (self._pending() or self._has_unsealed())
            and self._clock() < self._deadline
        ):
            self._pump(self._clock(), seal=True)
            if self._spool:
                break  # the collector is down: do not hold up the process's exit
            time.sleep(max(0.0, min(self._retry_at, self._deadline) - self._clock()))
        if self._inflight is not None or self._has_unsealed():
            self._to_spool()
        with self._lock:
            self._counters["spooled_at_close"] = len(self._spool) if self._spool else 0
            self._unsent_at_close = len(self._buffer) + (
                sum(self._inflight.records.values()) if self._inflight else 0
            )

    def _absorb_queued(self) -> None:
        with self._lock:
            queued, self._queued = self._queued, deque()
            layers, self._queued_layers = self._queued_layers, deque()
        for item in queued:
            if isinstance(item, StepSample):
                self._buffer.steps.append(step_record(item))
            else:
                self._buffer.events.append(item)
        for sample in layers:
            records = sample.records() if isinstance(sample, Fp8Sample) else [layer_record(sample)]
            self._buffer.layer_stats.extend(records)
            while len(self._buffer.layer_stats) > self._max_buffered_layer_stats:
                self._buffer.layer_stats.popleft()
                self._count({"layer_stats": 1}, reported=False)
        while len(self._buffer) > self._max_buffered:
            for kind in _DROP_ORDER:
                queue: deque[Any] = getattr(self._buffer, kind)
                if queue:
                    queue.popleft()
                    self._count({kind: 1}, reported=False)
                    break

    def _count(self, dropped: dict[str, int], *, reported: bool) -> None:
        """Count dropped records; `reported`: a batch's "dropped" field already says so."""
        with self._lock:
            for kind, n in dropped.items():
                self._dropped[kind] += n
                if not reported:
                    self._unreported[kind] += n

    def _count_lost(
        self, lost: dict[str, int], carried_before: dict[str, int], carried_after: dict[str, int]
    ) -> None:
        """Batches deleted from the spool: their records are new drops; the drop counts
        they carried were counted when they happened, and are only to be reported again."""
        with self._lock:
            for kind, n in lost.items():
                already = max(0, carried_before.get(kind, 0) - carried_after.get(kind, 0))
                self._dropped[kind] += max(0, n - already)
                self._unreported[kind] += n

    def _has_unsealed(self) -> bool:
        """Records, or counts of dropped ones, that no batch carries yet."""
        return bool(len(self._buffer) or any(self._unreported.values()))

    def _pending(self) -> bool:
        """Is there a sealed batch waiting for the collector?"""
        return self._inflight is not None or bool(self._spool)

    def _pump(self, now: float, *, seal: bool) -> None:
        """Seal and deliver: to the offline file; else, oldest first, until a try fails."""
        if self._offline is not None:
            if seal:
                self._write_offline()
            return
        if seal and self._spool:  # the collector is down: new batches queue up on disk
            self._to_spool()
        if now < self._retry_at:
            return
        while True:
            if self._inflight is not None:
                frame: Frame | None = self._inflight
            elif self._spool:
                try:
                    frame = self._spool.peek()
                except (OSError, ValueError) as exc:  # deleted or damaged under us
                    self._log_once(
                        "unreadable",
                        "ampwatch: a spooled batch is unreadable (%r); "
                        "its records are counted as dropped",
                        exc,
                    )
                    carried = self._spool.carried_drops()
                    lost = self._spool.pop()
                    self._count_lost(lost, carried, self._spool.carried_drops())
                    continue
            elif seal and self._has_unsealed():
                frame = self._inflight = self._seal()
            else:
                return
            if frame is None or not self._attempt(frame, now):
                return

    def _attempt(self, frame: Frame, now: float) -> bool:
        """One try; True if the batch was acknowledged and the next one may go now."""
        assert self._transport is not None
        try:
            status: int | None = self._transport(frame.body, dict(self._headers))
        except Exception as exc:  # noqa: BLE001 - any transport failure means "retry"
            status = None
            self._log_once(
                "down",
                "ampwatch: the collector is unreachable (%r); retrying, then spooling to disk",
                exc,
            )
        if status is not None and 200 <= status < 300:
            self._counters_add(batches_sent=1)
        else:
            self._counters_add(send_failures=1)
            self._failures += 1
            delay = retry_delay(self._failures, status, base=self._retry_base, cap=self._retry_cap)
            if delay is not None:
                self._retry_at = now + delay
                if frame is self._inflight and self._failures >= self._spool_after:
                    self._to_spool()
                return False
            self._reject(frame, status)
            self._retry_at = now + self._flush_interval
        if frame is self._inflight:
            self._inflight = None
        else:
            assert self._spool is not None
            self._spool.pop()
        self._failures = 0
        # After a rejection, wait a flush interval: its counts go in a new batch, and a
        # collector refusing everything (a bad token) must not get one in a tight loop.
        return status is not None and 200 <= status < 300

    def _reject(self, frame: Frame, status: int | None) -> None:
        """A 4xx will fail the same way again: drop the batch, count its records (and the
        drops it reported) for a later batch. Its seq is not reused: later batches may
        hold the next ones already, so the collector sees a gap there."""
        if status in (401, 403):
            self._log_once(
                "auth",
                "ampwatch: the collector refused this agent's token "
                "(HTTP %s): data is not stored. Check AMPWATCH_TOKEN / token=.",
                status,
            )
        else:
            self._log_once(
                f"http{status}",
                "ampwatch: the collector rejected a batch (HTTP %s); dropped",
                status,
            )
        self._counters_add(batches_rejected=1, auth_failures=int(status in (401, 403)))
        if not any(frame.records.values()):
            return  # it only carried counts: resending them to a collector refusing us loops
        with self._lock:
            for kind in _KINDS:
                self._dropped[kind] += frame.records[kind]
                self._unreported[kind] += frame.records[kind] + frame.drops[kind]

    def _to_spool(self) -> None:
        """Move the in-memory batch and everything buffered to the spool, in seq order.
        Without a spool (or when the disk fails) they stay in memory, bounded."""
        if self._spool is None:
            return
        while self._inflight is not None or self._has_unsealed():
            frame = self._inflight or self._seal()
            carried = self._spool.carried_drops()
            for kind, n in frame.drops.items():
                carried[kind] = carried.get(kind, 0) + n
            try:
                emptied, lost = self._spool.append(frame)
            except OSError as exc:
                self._log_once(
                    "spool",
                    "ampwatch: cannot write the spool in %s (%r); "
                    "keeping at most %d records in memory",
                    self._spool.directory,
                    exc,
                    self._max_buffered,
                )
                self._inflight = frame
                return
            self._inflight = None
            self._counters_add(batches_spooled=1)
            self._count(emptied, reported=True)
            for kind, n in emptied.items():  # stripped counts now ride in spooled batches
                carried[kind] = carried.get(kind, 0) + n
            self._count_lost(lost, carried, self._spool.carried_drops())

    def _write_offline(self) -> None:
        assert self._offline is not None
        while self._inflight is not None or self._has_unsealed():
            frame = self._inflight or self._seal()
            try:
                self._offline.parent.mkdir(parents=True, exist_ok=True)
                with self._offline.open("ab") as out:
                    out.write(encode_frame(frame.body))
            except OSError as exc:
                self._log_once(
                    "offline", "ampwatch: cannot write the offline file %s (%r)", self._offline, exc
                )
                self._inflight = frame
                return
            self._inflight = None
            self._counters_add(batches_sent=1)

    def _counters_add(self, **increments: int) -> None:
        with self._lock:
            for name, n in increments.items():
                self._counters[name] += n

    def _log_once(self, key: str, message: str, *args: object) -> None:
        """I/O trouble repeats every retry: say it once, count the rest."""
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(message, *args)

    def _seal(self) -> Frame:
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
            "stream": self._stream,
            "seq": self._seq,
            "steps": taken["steps"],
            "layer_stats": taken["layer_stats"],
            "events": taken["events"],
            "dropped": dropped,
        }
        self._seq += 1
        # default=str: an odd object in event data (a Path, a dtype) must not stop the sender
        text = json.dumps(batch, allow_nan=False, default=str)
        body = gzip.compress(text.encode(), compresslevel=5)
        return Frame(batch["seq"], body, {kind: len(taken[kind]) for kind in _KINDS}, dropped)
