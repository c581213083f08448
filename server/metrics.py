"""`/metrics` in the Prometheus text exposition format (version 0.0.4), written by hand.

Three kinds of series, named so that nobody mistakes one for the other:

- Read from the database at scrape time, so every worker answers the same: runs by
  project and status (a gauge: deleting a run lowers it). No count of stored batches:
  it was a scan of every batch ever stored (20 M rows after a month of 1,000 runs), on
  every scrape; the ingest counters below give the rate.
- Per run (`ampwatch_run_*`, `ampwatch.server.run_metrics`), also from the database:
  loss scale, steps, skips, health, firing alerts, lag, the agent's dropped records, for
  running runs and recently ended ones.
- The collector's ingest counters: batches, duplicates, steps and layer values accepted,
  and ingest requests rejected, by reason. They describe traffic that is not stored (a
  rejected batch leaves no row), so they cannot come from the database. Every worker
  process of one `ampwatch serve` counts in a file of its own in a folder they share
  (`Settings.metrics_dir`; `serving.serve` makes one), and any worker's scrape sums them
  all: Prometheus keeps one connection to its one target, so it always talks to the same
  worker, and per-process counters (as before, labelled `pid`) read 750 steps against
  1,180 stored with two workers. The file of a worker that died stays, so the sums never
  go down while the collector runs. One process (the tests', the demo's) counts in memory.

A scrape for one project (a token of that project, `render(project=...)`) holds that
project's database series only: the ingest counters count every project's traffic.

No prometheus_client dependency: its registry suits values kept in process memory, while
nearly all of these are read from the database per scrape (a custom collector would be
this module again); its multi-process mode is what `IngestCounters` does for five counters.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.server import run_metrics
from ampwatch.server.exposition import escape, render_labels
from ampwatch.server.exposition import family as _family
from ampwatch.server.models import Run

#: Why an ingest request was refused, by HTTP status (`IngestCounters.record_rejection`).
REJECTION_REASONS = {
    400: "bad_encoding",
    401: "unauthenticated",
    403: "forbidden",
    413: "too_large",
    415: "unsupported_encoding",
    422: "invalid",
}


#: The counters' slots, each an int64 in a process's counter file: the four totals, then
#: rejections by status, 400 to 499.
_TOTALS = ("batches", "duplicates", "steps", "layer_values")
_SLOT = struct.Struct("<q")
_SLOTS = len(_TOTALS) + 100
#: A process's counter file: `<pid>.counters` (`serving.serve` clears them on start).
COUNTER_FILE_SUFFIX = ".counters"


class IngestCounters:
    """The collector's ingest traffic; one instance per app (`app.state.ingest_counters`).

    `folder` None: this process's counts, in memory. A folder: this process counts in
    `<folder>/<pid>.counters` (memory-mapped: an increment is a write to memory), and
    `totals` sums every file there, the counts of every worker of the collector.
    """

    def __init__(self, folder: Path | None = None) -> None:
        self._lock = threading.Lock()  # endpoints run on a thread pool
        self._folder = folder
        self._values: bytearray | mmap.mmap
        if folder is None:
            self._values = bytearray(_SLOTS * _SLOT.size)
            return
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{os.getpid()}{COUNTER_FILE_SUFFIX}"
        with path.open("w+b") as file:
            file.truncate(_SLOTS * _SLOT.size)
            self._values = mmap.mmap(file.fileno(), _SLOTS * _SLOT.size)

    def _add(self, counts: dict[int, int]) -> None:
        """Add `counts` (slot: count) to this process's slots."""
        with self._lock:
            for slot, count in counts.items():
                offset = slot * _SLOT.size
                value = _SLOT.unpack_from(self._values, offset)[0] + count
                _SLOT.pack_into(self._values, offset, value)

    def record_batch(self, *, steps: int, layer_values: int, duplicate: bool) -> None:
        """Count an acknowledged batch of `steps` and `layer_values`; a duplicate's
        contents were not stored again."""
        if duplicate:
            self._add({_TOTALS.index("duplicates"): 1})
            return
        self._add({_TOTALS.index("batches"): 1, _TOTALS.index("steps"): steps,
                   _TOTALS.index("layer_values"): layer_values})  # fmt: skip

    def record_rejection(self, status: int) -> None:
        if 400 <= status < 500:
            self._add({len(_TOTALS) + status - 400: 1})

    def totals(self) -> tuple[dict[str, int], Counter[str]]:
        """The totals (`_TOTALS`) and the rejections by reason, of every process counting
        in the folder (of this one without a folder)."""
        if self._folder is None:
            with self._lock:
                tables = [bytes(self._values)]
        else:  # a file being created may still be short: it counts from its next scrape
            tables = [path.read_bytes() for path in self._folder.glob(f"*{COUNTER_FILE_SUFFIX}")]
        sums = [0] * _SLOTS
        for table in tables:
            if len(table) == _SLOTS * _SLOT.size:
                for slot, (value,) in enumerate(_SLOT.iter_unpack(table)):
                    sums[slot] += value
        rejected: Counter[str] = Counter()
        for status in range(400, 500):
            count = sums[len(_TOTALS) + status - 400]
            if count:
                rejected[REJECTION_REASONS.get(status, str(status))] += count
        return dict(zip(_TOTALS, sums)), rejected


Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]


class CountRejections:
    """ASGI middleware counting 4xx answers to `POST path`, wherever they were raised
    (body limits and auth answer before the endpoint runs)."""

    def __init__(self, app: ASGIApp, *, path: str, counters: IngestCounters) -> None:
        self.app = app
        self.path = path
        self.counters = counters

    async def __call__(
        self,
        scope: Message,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                self.counters.record_rejection(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def _labelled(samples: Iterable[tuple[dict[str, str], float]]) -> Iterator[tuple[str, float]]:
    return ((render_labels(labels), value) for labels, value in samples)


def render(
    session: Session,
    counters: IngestCounters,
    *,
    now: datetime,
    ended_window: float,
    max_runs: int,
    project: str | None = None,
) -> str:
    """The exposition text: database series (of `project` only, when given), per-run
    series, then the collector's ingest counters (only when every project is scraped)."""
    scoped = [Run.project == project] if project is not None else []
    runs = session.execute(
        select(Run.project, Run.status, func.count())
        .where(*scoped)
        .group_by(Run.project, Run.status)
    ).all()
    per_run = run_metrics.collect(
        session, now=now, ended_window=ended_window, max_runs=max_runs, project=project
    )
    lines = [
        *_family("ampwatch_runs", "gauge", "Runs stored, by project and status.",
                 _labelled(({"project": p, "status": s}, n) for p, s, n in runs)),
        *_family("ampwatch_metrics_runs_omitted", "gauge",
                 "Runs left out of the per-run series by AMPWATCH_METRICS_MAX_RUNS.",
                 [("", per_run.omitted)]),
    ]  # fmt: skip
    for family in run_metrics.FAMILIES:
        samples = run_metrics.family_samples(family, per_run.runs)
        lines += _family(family.name, family.kind, family.help, samples)
    if project is None:
        lines += _collector_counters(counters)
    return "\n".join(lines) + "\n"


def _collector_counters(counters: IngestCounters) -> list[str]:
    totals, rejected = counters.totals()
    return [
        *_family("ampwatch_ingest_batches_total", "counter",
                 "Batches stored by the collector.", [("", totals["batches"])]),
        *_family("ampwatch_ingest_duplicate_batches_total", "counter",
                 "Batches the collector acknowledged as already stored.",
                 [("", totals["duplicates"])]),
        *_family("ampwatch_ingest_steps_total", "counter",
                 "Step records stored by the collector.", [("", totals["steps"])]),
        *_family("ampwatch_ingest_layer_values_total", "counter",
                 "Layer-statistic values stored by the collector.",
                 [("", totals["layer_values"])]),
        *_family("ampwatch_ingest_rejected_total", "counter",
                 "Ingest requests the collector refused, by reason.",
                 ((f'reason="{escape(r)}"', n) for r, n in sorted(rejected.items()))),
    ]  # fmt: skip
