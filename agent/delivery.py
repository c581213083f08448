"""Getting sealed batches to the collector: in order, retried, spooled to disk while the
collector is down, or written to the offline file; and the options that tune it.

A batch is retried in memory `spool_after` times; after that the collector counts as
down: the batch and everything sealed after it go to the on-disk spool
(`ampwatch.agent.spool`), which is replayed oldest first, one probe per backoff delay
(`ampwatch.agent.retry`), when the collector answers again. The collector acknowledges a
batch it already stored as a duplicate, so resending the same (run, stream, seq) after a
lost acknowledgement is safe: delivery is exactly once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ampwatch.agent import wire
from ampwatch.agent.batching import RecordBuffer, Tally
from ampwatch.agent.http_transport import Answer, Transport, request_headers
from ampwatch.agent.retry import retry_delay
from ampwatch.agent.spool import Frame, Spool, default_spool_dir, encode_frame

logger = logging.getLogger("ampwatch.agent")

#: Default spool bound: hours of step scalars for a large model; layer statistics go first.
DEFAULT_SPOOL_MAX_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class DeliveryOptions:
    """How the agent's sender buffers, retries and spools: `watch(..., delivery=...)`.

    The defaults suit a real run; tests and soak benches shorten the retry cap or bound
    the spool, and drive `clock`/`sleep` with a fake clock and `Sender.tick()`.

        watch(model, optimizer, scaler, delivery=DeliveryOptions(retry_cap=1.0))
    """

    #: Keep batches the collector did not take on disk (False: in memory only, bounded).
    spool: bool = True
    #: Where; default `default_spool_dir(run id)` (AMPWATCH_SPOOL_DIR, else the user cache).
    spool_dir: str | os.PathLike[str] | None = None
    #: The spool's bound on disk; when full, its oldest layer statistics go first.
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    #: Tries of a batch in memory before the collector counts as down and it is spooled.
    spool_after: int = 3
    #: Records per batch at most (a full buffer seals one before the flush interval).
    max_batch_records: int = 2_000
    #: Records buffered in memory at most; layer statistics are dropped first.
    max_buffered: int = 10_000
    #: Of which layer-statistic records (the bulky ones) at most.
    max_buffered_layer_stats: int = 100
    #: First retry delay and the delay's cap, seconds (`ampwatch.agent.retry`).
    retry_base: float = 0.5
    retry_cap: float = 30.0
    #: Monotonic seconds, and the wait the close-time flush uses between tries.
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        for name in ("spool_after", "spool_max_bytes", "max_batch_records", "max_buffered"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DeliveryOptions.{name} must be an int >= 1, got {value!r}")
        if not self.max_buffered_layer_stats >= 0:
            raise ValueError("DeliveryOptions.max_buffered_layer_stats must be >= 0")
        if not (self.retry_base > 0 and self.retry_cap > 0):
            raise ValueError("DeliveryOptions.retry_base and retry_cap must be > 0 seconds")


class Delivery:
    """Delivers sealed batches, oldest first (sender thread only). One batch is in memory
    at a time (`inflight`) while the spool is empty; the spool holds the rest."""

    def __init__(
        self,
        run: wire.RunRef,
        transport: Transport | None,
        buffer: RecordBuffer,
        tally: Tally,
        *,
        token: str | None,
        offline_file: str | os.PathLike[str] | None,
        flush_interval: float,
        options: DeliveryOptions,
        on_answer: Callable[[bytes], None] | None = None,
    ) -> None:
        if transport is None and offline_file is None:
            raise ValueError("pass a transport, or offline_file to write batches to a file")
        self._transport = transport
        self._buffer = buffer
        self._tally = tally
        self._headers = request_headers(token)
        self.offline = Path(offline_file) if offline_file is not None else None
        self.spool: Spool | None = None
        if options.spool and self.offline is None:
            directory = (
                Path(options.spool_dir)
                if options.spool_dir
                else default_spool_dir(run["client_run_id"])
            )
            self.spool = Spool(directory, max_bytes=options.spool_max_bytes)
        self._options = options
        self._flush_interval = flush_interval
        #: Reads each acknowledgement's body (`ampwatch.agent.policy.AlertPolicy.hear`).
        self._on_answer = on_answer
        self.inflight: Frame | None = None  # the oldest batch when the spool is empty
        self._failures = 0  # consecutive failed tries of the oldest batch
        self.retry_at = 0.0
        self._logged: set[str] = set()

    def pending(self) -> bool:
        """Is there a sealed batch waiting for the collector?"""
        return self.inflight is not None or bool(self.spool)

    def inflight_records(self) -> int:
        inflight = self.inflight
        return sum(inflight.records.values()) if inflight is not None else 0

    def pump(self, now: float, *, seal: bool) -> None:
        """Seal and deliver: to the offline file; else, oldest first, until a try fails."""
        if self.offline is not None:
            if seal:
                self._write_offline()
            return
        if seal and self.spool:  # the collector is down: new batches queue up on disk
            self.to_spool()
        if now < self.retry_at:
            return
        while True:
            if self.inflight is not None:
                frame: Frame | None = self.inflight
            elif self.spool:
                try:
                    frame = self.spool.peek()
                except (OSError, ValueError) as exc:  # deleted or damaged under us
                    self._log_once(
                        "unreadable",
                        "ampwatch: a spooled batch is unreadable (%r); "
                        "its records are counted as dropped",
                        exc,
                    )
                    carried = self.spool.carried_drops()
                    lost = self.spool.pop()
                    self._tally.lost(lost, carried, self.spool.carried_drops())
                    continue
            elif seal and self._buffer.has_unsealed():
                frame = self.inflight = self._buffer.seal()
            else:
                return
            if frame is None or not self._attempt(frame, now):
                return

    def finish(self, deadline: float) -> None:
        """At close: deliver until done or `deadline`; then spool what is left."""
        clock = self._options.clock
        if self.offline is not None:
            self.pump(clock(), seal=True)
        elif self.spool:
            self.retry_at = 0.0  # one try now: the collector may be back
        while (
            self.offline is None
            and (self.pending() or self._buffer.has_unsealed())
            and clock() < deadline
        ):
            self.pump(clock(), seal=True)
            if self.spool:
                break  # the collector is down: do not hold up the process's exit
            self._options.sleep(max(0.0, min(self.retry_at, deadline) - clock()))
        if self.inflight is not None or self._buffer.has_unsealed():
            self.to_spool()
        self._tally.set("spooled_at_close", len(self.spool) if self.spool else 0)

    def _attempt(self, frame: Frame, now: float) -> bool:
        """One try; True if the batch was acknowledged and the next one may go now."""
        assert self._transport is not None
        try:
            status: int | None = self._transport(frame.body, dict(self._headers))
        except Exception as exc:  # noqa: BLE001 - any transport failure means "retry"
            status = None
            self._log_once(
                "down",
                "ampwatch: the collector is unreachable (%r); retrying, then spooling to "
                "disk; no alert can come back until it answers",
                exc,
            )
        if status is not None and 200 <= status < 300:
            self._tally.add(batches_sent=1)
            if self._on_answer is not None and isinstance(status, Answer):
                try:
                    self._on_answer(status.body)
                except Exception as exc:  # noqa: BLE001 - the sender thread must go on
                    self._log_once(
                        "answer", "ampwatch: cannot read the collector's answer (%r)", exc
                    )
        else:
            self._tally.add(send_failures=1)
            self._failures += 1
            options = self._options
            delay = retry_delay(
                self._failures, status, base=options.retry_base, cap=options.retry_cap
            )
            if delay is not None:
                self.retry_at = now + delay
                if frame is self.inflight and self._failures >= options.spool_after:
                    self.to_spool()
                return False
            self._reject(frame, status)
            self.retry_at = now + self._flush_interval
        if frame is self.inflight:
            self.inflight = None
        else:
            assert self.spool is not None
            self.spool.pop()
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
        self._tally.add(batches_rejected=1, auth_failures=int(status in (401, 403)))
        if not any(frame.records.values()):
            return  # it only carried counts: resending them to a collector refusing us loops
        self._tally.rejected(frame)

    def to_spool(self) -> None:
        """Move the in-memory batch and everything buffered to the spool, in seq order.
        Without a spool (or when the disk fails) they stay in memory, bounded."""
        if self.spool is None:
            return
        while self.inflight is not None or self._buffer.has_unsealed():
            frame = self.inflight or self._buffer.seal()
            carried = self.spool.carried_drops()
            for kind, n in frame.drops.items():
                carried[kind] = carried.get(kind, 0) + n
            try:
                emptied, lost = self.spool.append(frame)
            except OSError as exc:
                self._log_once(
                    "spool",
                    "ampwatch: cannot write the spool in %s (%r); "
                    "keeping at most %d records in memory",
                    self.spool.directory,
                    exc,
                    self._buffer.max_buffered,
                )
                self.inflight = frame
                return
            self.inflight = None
            self._tally.add(batches_spooled=1)
            self._tally.drop(emptied, reported=True)
            for kind, n in emptied.items():  # stripped counts now ride in spooled batches
                carried[kind] = carried.get(kind, 0) + n
            self._tally.lost(lost, carried, self.spool.carried_drops())

    def _write_offline(self) -> None:
        assert self.offline is not None
        while self.inflight is not None or self._buffer.has_unsealed():
            frame = self.inflight or self._buffer.seal()
            try:
                self.offline.parent.mkdir(parents=True, exist_ok=True)
                with self.offline.open("ab") as out:
                    out.write(encode_frame(frame.body))
            except OSError as exc:
                self._log_once(
                    "offline", "ampwatch: cannot write the offline file %s (%r)", self.offline, exc
                )
                self.inflight = frame
                return
            self.inflight = None
            self._tally.add(batches_sent=1)

    def _log_once(self, key: str, message: str, *args: object) -> None:
        """I/O trouble repeats every retry: say it once, count the rest."""
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(message, *args)
