"""`/metrics` in the Prometheus text exposition format (version 0.0.4), written by hand.

Three kinds of series, named so that nobody mistakes one for the other:

- Read from the database at scrape time, so every worker answers the same: runs by
  project and status (a gauge: deleting a run lowers it). No count of stored batches:
  it was a scan of every batch ever stored (20 M rows after a month of 1,000 runs), on
  every scrape; the ingest counters below give the rate.
- Per run (`ampwatch_run_*`, `ampwatch.server.run_metrics`), also from the database:
  loss scale, steps, skips, health, firing alerts, lag, the agent's dropped records, for
  running runs and recently ended ones.
- Counted by this process, labelled `pid`: batches, duplicates, steps and layer values
  accepted, and ingest requests rejected, by reason. They describe traffic that is not
  stored (a rejected batch leaves no row), so they cannot come from the database; with
  several workers, scrape each one (a container per worker), as for any Prometheus
  client, and `sum without (pid)`.

A scrape for one project (a token of that project, `render(project=...)`) holds that
project's database series only: the per-process counters count every project's traffic.

No prometheus_client dependency: its registry suits values kept in process memory, while
nearly all of these are read from the database per scrape (a custom collector would be
this module again), and its multi-process mode needs a shared directory that several
hosts do not have.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.server import run_metrics
from ampwatch.server.exposition import escape, render_labels
from ampwatch.server.exposition import family as _family
from ampwatch.server.models import Run
from ampwatch.server.schemas.wire import BatchIn

#: Why an ingest request was refused, by HTTP status (`IngestCounters.record_rejection`).
REJECTION_REASONS = {
    400: "bad_encoding",
    401: "unauthenticated",
    403: "forbidden",
    413: "too_large",
    415: "unsupported_encoding",
    422: "invalid",
}


class IngestCounters:
    """This process's ingest traffic; one instance per app (`app.state.ingest_counters`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # endpoints run on a thread pool
        self.batches = 0
        self.duplicates = 0
        self.steps = 0
        self.layer_values = 0
        self.rejected: Counter[str] = Counter()

    def record_batch(self, batch: BatchIn, *, duplicate: bool) -> None:
        """Count an acknowledged batch; a duplicate's contents were not stored again."""
        values = sum(len(r.names) * len(r.stats) for r in batch.layer_stats)
        with self._lock:
            if duplicate:
                self.duplicates += 1
                return
            self.batches += 1
            self.steps += len(batch.steps)
            self.layer_values += values

    def record_rejection(self, status: int) -> None:
        with self._lock:
            self.rejected[REJECTION_REASONS.get(status, str(status))] += 1


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
    series, then this process's counters (only when every project is scraped)."""
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
        lines += _process_counters(counters)
    return "\n".join(lines) + "\n"


def _process_counters(counters: IngestCounters) -> list[str]:
    pid = render_labels({"pid": str(os.getpid())})
    with counters._lock:
        return [
            *_family("ampwatch_ingest_batches_total", "counter",
                     "Batches stored by this process.", [(pid, counters.batches)]),
            *_family("ampwatch_ingest_duplicate_batches_total", "counter",
                     "Batches this process acknowledged as already stored.",
                     [(pid, counters.duplicates)]),
            *_family("ampwatch_ingest_steps_total", "counter",
                     "Step records stored by this process.", [(pid, counters.steps)]),
            *_family("ampwatch_ingest_layer_values_total", "counter",
                     "Layer-statistic values stored by this process.",
                     [(pid, counters.layer_values)]),
            *_family("ampwatch_ingest_rejected_total", "counter",
                     "Ingest requests this process refused, by reason.",
                     ((f'{pid},reason="{escape(r)}"', n)
                      for r, n in sorted(counters.rejected.items()))),
        ]  # fmt: skip
