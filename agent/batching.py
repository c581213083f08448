"""Between `Sender.put` and delivery: the bounded sample queue the training thread fills,
the record buffer the sender thread drains it into, sealing batches, and the drop counts.

Every bound drops the bulky per-layer statistics first and counts what it drops; the
counts not yet carried by a batch ride in the next one's "dropped" field.
"""

from __future__ import annotations

import gzip
import json
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ampwatch.agent import wire
from ampwatch.agent.fp8 import Fp8Sample
from ampwatch.agent.records import LayerSample, StepSample, layer_record, step_record
from ampwatch.agent.spool import Frame

KINDS = wire.DROPPED_KINDS
COUNTERS = (
    "batches_sent",
    "send_failures",
    "batches_rejected",
    "auth_failures",
    "batches_spooled",
    "spooled_at_close",
)
#: Under memory pressure: per-layer statistics first, the alerting per-step series next.
_DROP_ORDER = ("layer_stats", "steps", "events")

Sample = StepSample | LayerSample | Fp8Sample | wire.EventRecord
logger = logging.getLogger("ampwatch.agent")


def kind_of(item: Sample) -> str:
    """The wire list `item` ends up in: "steps", "layer_stats" or "events"."""
    if isinstance(item, StepSample):
        return "steps"
    return "layer_stats" if isinstance(item, (LayerSample, Fp8Sample)) else "events"


class Tally:
    """Delivery counters and drop counts, shared by both threads under one lock.

    `dropped`: every record lost so far, per kind (the handle's counters). `unreported`:
    drops no sealed batch carries yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dropped = dict.fromkeys(KINDS, 0)
        self._unreported = dict.fromkeys(KINDS, 0)
        self._counters = dict.fromkeys(COUNTERS, 0)

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, n in increments.items():
                self._counters[name] += n

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._counters[name] = value

    def get(self, name: str) -> int:
        with self._lock:
            return self._counters[name]

    def drop(self, dropped: dict[str, int], *, reported: bool) -> None:
        """Count dropped records; `reported`: a batch's "dropped" field already says so."""
        with self._lock:
            for kind, n in dropped.items():
                self._dropped[kind] += n
                if not reported:
                    self._unreported[kind] += n

    def lost(
        self, lost: dict[str, int], carried_before: dict[str, int], carried_after: dict[str, int]
    ) -> None:
        """Batches deleted from the spool: their records are new drops; the drop counts
        they carried were counted when they happened, and are only to be reported again."""
        with self._lock:
            for kind, n in lost.items():
                already = max(0, carried_before.get(kind, 0) - carried_after.get(kind, 0))
                self._dropped[kind] += max(0, n - already)
                self._unreported[kind] += n

    def rejected(self, frame: Frame) -> None:
        """A batch the collector refused: its records are dropped, and they and the drops
        it reported go in a later batch."""
        with self._lock:
            for kind in KINDS:
                self._dropped[kind] += frame.records[kind]
                self._unreported[kind] += frame.records[kind] + frame.drops[kind]

    def has_unreported(self) -> bool:
        with self._lock:
            return any(self._unreported.values())

    def take_unreported(self) -> dict[str, int]:
        with self._lock:
            taken, self._unreported = self._unreported, dict.fromkeys(KINDS, 0)
            return taken

    def snapshot(self, unsent_at_close: int) -> dict[str, int]:
        with self._lock:
            return {
                **self._counters,
                **{f"dropped_{kind}": n for kind, n in self._dropped.items()},
                "unsent_at_close": unsent_at_close,
            }


def idle_counters() -> dict[str, int]:
    """The counters of a sender that never ran (a disabled agent): same keys, all 0."""
    return Tally().snapshot(0)


class SampleQueue:
    """What the training thread hands over, bounded by `max_queue` samples.

    Two deques under one lock rather than a queue.Queue: a full queue must be able to
    evict its oldest layer sample, which a Queue cannot do."""

    def __init__(self, max_queue: int, tally: Tally) -> None:
        self.max_queue = max_queue
        self._tally = tally
        self._lock = threading.Lock()
        #: Steps and events, in order.
        self.samples: deque[StepSample | wire.EventRecord] = deque()
        self.layers: deque[LayerSample | Fp8Sample] = deque()

    def __len__(self) -> int:
        return len(self.samples) + len(self.layers)

    def put(self, item: Sample) -> int | None:
        """Queue `item`; the queue's length after, or None if `item` was dropped. When
        the queue is full the oldest queued layer sample makes room (for an event: else
        the oldest step); failing that, `item` is dropped."""
        with self._lock:
            queued = len(self.samples) + len(self.layers)
            if queued >= self.max_queue:
                evicted = "layer_stats" if self.layers else None
                if evicted:
                    self.layers.popleft()
                elif kind_of(item) == "events":
                    # Events are rare and say what steps cannot (run end, checkpoints for
                    # the restart advisor): the oldest queued step makes room for one.
                    oldest = next(
                        (i for i, q in enumerate(self.samples) if isinstance(q, StepSample)), None
                    )
                    if oldest is not None:
                        del self.samples[oldest]
                        evicted = "steps"
                if evicted is None:
                    self._tally.drop({kind_of(item): 1}, reported=False)
                    return None
                self._tally.drop({evicted: 1}, reported=False)
                queued -= 1
            if isinstance(item, (LayerSample, Fp8Sample)):
                self.layers.append(item)
            else:
                self.samples.append(item)
            return queued + 1

    def drain(self) -> tuple[deque[StepSample | wire.EventRecord], deque[LayerSample | Fp8Sample]]:
        """Everything queued, emptied out (samples in order, layer samples in order)."""
        with self._lock:
            samples, self.samples = self.samples, deque()
            layers, self.layers = self.layers, deque()
        return samples, layers


@dataclass
class _Records:
    steps: deque[wire.StepRecord] = field(default_factory=deque)
    layer_stats: deque[wire.LayerStatsRecord] = field(default_factory=deque)
    events: deque[wire.EventRecord] = field(default_factory=deque)


class RecordBuffer:
    """Wire records waiting for a batch (sender thread only), and the batch numbering.

    Bounds: `max_buffered` records, of which at most `max_buffered_layer_stats` layer
    statistics. Batches carry this buffer's `stream` (a fresh uuid4: the ranks of a
    distributed run and a run resumed under the same run id each number seq from 0, and
    must not collide) and the next `seq`, kept for good by every resend."""

    def __init__(
        self,
        run: wire.RunRef,
        tally: Tally,
        *,
        max_batch_records: int,
        max_buffered: int,
        max_buffered_layer_stats: int,
    ) -> None:
        self._run = run
        self._tally = tally
        self.max_batch_records = max_batch_records
        self.max_buffered = max_buffered
        self._max_buffered_layer_stats = max_buffered_layer_stats
        self._records = _Records()
        self.stream = uuid.uuid4().hex
        self._seq = 0
        self._build_failed = False

    def __len__(self) -> int:
        r = self._records
        return len(r.steps) + len(r.layer_stats) + len(r.events)

    def absorb(
        self,
        samples: deque[StepSample | wire.EventRecord],
        layers: deque[LayerSample | Fp8Sample],
    ) -> None:
        """Turn drained samples into wire records (waiting for their device copies),
        dropping the oldest past the bounds."""
        buffered = self._records
        for item in samples:
            if isinstance(item, StepSample):
                if (step := self._built(step_record, item, "steps")) is not None:
                    buffered.steps.append(step)
            else:
                buffered.events.append(item)
        for sample in layers:
            if isinstance(sample, Fp8Sample):
                records = self._built(Fp8Sample.records, sample, "layer_stats") or []
            else:
                built = self._built(layer_record, sample, "layer_stats")
                records = [] if built is None else [built]
            buffered.layer_stats.extend(records)
            while len(buffered.layer_stats) > self._max_buffered_layer_stats:
                buffered.layer_stats.popleft()
                self._tally.drop({"layer_stats": 1}, reported=False)
        while len(self) > self.max_buffered:
            for kind in _DROP_ORDER:
                kept: deque[Any] = getattr(buffered, kind)
                if kept:
                    kept.popleft()
                    self._tally.drop({kind: 1}, reported=False)
                    break

    def _built(self, build: Callable[[Any], Any], sample: Any, kind: str) -> Any:
        """`build(sample)`, or None, counted as a drop and logged once: a sample the sender
        cannot turn into a record (an odd tensor) costs that record, never the thread."""
        try:
            return build(sample)
        except Exception:  # the sender thread must outlive any one sample
            if not self._build_failed:
                self._build_failed = True
                logger.exception("ampwatch could not build a %s record; it is dropped", kind)
            self._tally.drop({kind: 1}, reported=False)
            return None

    def has_unsealed(self) -> bool:
        """Records, or counts of dropped ones, that no batch carries yet."""
        return bool(len(self) or self._tally.has_unreported())

    def seal(self) -> Frame:
        """The next batch: up to `max_batch_records` records, events first, then steps."""
        budget = self.max_batch_records
        taken: dict[str, list[Any]] = {}
        for kind in ("events", "steps", "layer_stats"):
            records: deque[Any] = getattr(self._records, kind)
            n = min(budget, len(records))
            taken[kind] = [records.popleft() for _ in range(n)]
            budget -= n
        dropped = self._tally.take_unreported()
        batch: wire.Batch = {
            "wire_version": wire.WIRE_VERSION,
            "run": self._run,
            "stream": self.stream,
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
        return Frame(batch["seq"], body, {kind: len(taken[kind]) for kind in KINDS}, dropped)
