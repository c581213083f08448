"""The background sender: one daemon thread between the training thread and the collector.

The training thread only calls `Sender.put` (never blocks: on a full queue the oldest
sampled layer statistics make room, then, for an event, the oldest step; a step that finds
no room is dropped and counted; `ampwatch.agent.batching`). The sender thread wakes once
per flush interval, waits for each sample's device-to-host copy, turns samples into wire
records and seals gzip JSON batches (`batching`), and delivers them in order, retried and
spooled while the collector is down (`ampwatch.agent.delivery`). Offline mode writes sealed
batches only to a file, for `ampwatch upload`.

The owner (`WatchHandle`) closes the sender at detach and from an `atexit` hook, so a run
that ends without `detach()` still flushes, for a bounded time; what is still unsent then
stays in the spool, on disk, for `ampwatch upload`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from ampwatch.agent import wire
from ampwatch.agent.batching import RecordBuffer, Sample, SampleQueue, Tally
from ampwatch.agent.delivery import Delivery, DeliveryOptions
from ampwatch.agent.http_transport import Transport, http_transport

logger = logging.getLogger("ampwatch.agent")

#: `Transport` and `http_transport` live in `ampwatch.agent.http_transport`; they stay
#: importable from here, where integrations and tests have always imported them.
__all__ = ["Sender", "Transport", "http_transport"]


class Sender:
    """Owns the sender thread. `put` from the training thread; `close(timeout)` at the end.

    Bounds: the queue holds `max_queue` samples; the buffer, the spool and the retries
    are `delivery`'s (`DeliveryOptions`). Delivery: `transport` (stdlib HTTP in `watch()`),
    with `token` as a bearer token; `offline_file`: append sealed batches to that file
    instead and never use the network. `on_answer`: called on this thread with the body of
    each acknowledgement (`ampwatch.agent.policy`).

    A sender that is never `start()`ed is driven by `tick()`, which does one pass of the
    thread's work at the injected clock's time (tests), and flushed by `close()` in the
    caller's thread.
    """

    def __init__(
        self,
        run: wire.RunRef,
        transport: Transport | None,
        *,
        token: str | None = None,
        offline_file: str | os.PathLike[str] | None = None,
        flush_interval: float = 1.0,
        max_queue: int = 10_000,
        delivery: DeliveryOptions = DeliveryOptions(),  # noqa: B008 - frozen, shared
        on_answer: Callable[[bytes], None] | None = None,
    ) -> None:
        self._tally = Tally()
        self._queue = SampleQueue(max_queue, self._tally)
        self._buffer = RecordBuffer(
            run,
            self._tally,
            max_batch_records=delivery.max_batch_records,
            max_buffered=delivery.max_buffered,
            max_buffered_layer_stats=delivery.max_buffered_layer_stats,
        )
        self._delivery = Delivery(
            run,
            transport,
            self._buffer,
            self._tally,
            token=token,
            offline_file=offline_file,
            flush_interval=flush_interval,
            options=delivery,
            on_answer=on_answer,
        )
        self._clock = delivery.clock
        self._flush_interval = flush_interval
        self._next_flush = self._clock() + flush_interval
        self._wake = threading.Event()
        self._wake_at = max(1, max_queue // 4)
        self._unsent_at_close = 0
        self._deadline: float | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._run_thread, name="ampwatch-sender", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def put(self, item: Sample) -> None:
        """Hand a sample to the sender; never blocks, never raises. When the queue is full
        the oldest queued layer sample makes room (for an event: else the oldest step);
        failing that, `item` is dropped."""
        if self._closed:
            return
        queued = self._queue.put(item)
        if queued is not None and queued >= self._wake_at:
            self._wake.set()

    def counters(self) -> dict[str, int]:
        return self._tally.snapshot(self._unsent_at_close)

    def tick(self) -> None:
        """One pass of the sender thread's work, at `clock()`: take what `put` queued, seal
        a batch when the flush interval has passed (or a batch's worth is buffered), and
        deliver what is due. For a sender that is not started (tests drive the clock);
        the thread runs this once per wake-up."""
        self._buffer.absorb(*self._queue.drain())
        now = self._clock()
        seal = now >= self._next_flush or len(self._buffer) >= self._buffer.max_batch_records
        if seal:
            self._next_flush = now + self._flush_interval
        self._delivery.pump(now, seal=seal)

    def close(self, timeout: float = 5.0) -> bool:
        """Flush for at most `timeout` seconds; True if everything reached the collector
        (or the offline file). What is left is spooled (`spooled_at_close` batches) or, if
        it could not be, counted in `unsent_at_close` records."""
        if self._closed:
            return self._flushed()
        # The thread stops sending a little before `timeout`, to spool and count what is left.
        self._deadline = self._clock() + 0.8 * timeout
        self._closed = True
        if self._thread.ident is None:  # never started: tick()-driven, flush here
            self._finish()
            return self._flushed()
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            # Stuck in a transport call: count what it still holds.
            self._unsent_at_close = (
                len(self._queue) + len(self._buffer) + self._delivery.inflight_records()
            )
        return self._flushed()

    def _flushed(self) -> bool:
        return self._unsent_at_close == 0 and self._tally.get("spooled_at_close") == 0

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
        self._next_flush = self._clock() + self._flush_interval
        while not self._closed:
            wake = self._next_flush
            if self._delivery.pending():
                wake = min(wake, self._delivery.retry_at)
            self._wake.wait(max(0.0, wake - self._clock()))
            self._wake.clear()
            self.tick()
        self._finish()

    def _finish(self) -> None:
        """At close: deliver until done or the deadline; then spool what is left."""
        assert self._deadline is not None
        self._buffer.absorb(*self._queue.drain())
        self._delivery.finish(self._deadline)
        self._unsent_at_close = len(self._buffer) + self._delivery.inflight_records()
