"""Per-run series for `/metrics`: what a Prometheus graphs and Alertmanager routes per run.

Which runs: every running run, and ended runs whose last data is younger than
`Settings.metrics_ended_window` (so the last values and the resolution of their alerts
are scraped once more before the series go stale), at most `Settings.metrics_max_runs`
(running ones first, then the most recently seen; `ampwatch_metrics_runs_omitted` says how
many the cap left out). A run costs eleven series (ten while ended: no lag) plus one per
(rule, severity) firing; no series is labelled by layer: a layer alert counts in its
rule's `ampwatch_run_alerts_firing`.

Cost: four queries whatever the number of runs or their length, never one per run (the
chosen run ids, plus their count when the cap is reached; the runs with their step totals
and last loss scale; the skip ratios, an index range of each rank's last 16 step rollups;
the firing alerts by rule and severity). Step counts come from `run_step_totals`, a row
per rank kept by ingest: summing the rollups instead cost ~26 ms for 1,000 runs of 10,000
steps here, ten times that for 100k-step runs. `bench/metrics.py` measures a scrape
with 1,000 live runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, case, func, or_, select, text
from sqlalchemy.orm import Session

from ampwatch.agent.wire import DROPPED_KINDS
from ampwatch.server.exposition import render_labels
from ampwatch.server.models import HEALTHS, Alert, Run
from ampwatch.server.queries import SKIP_RATE_BUCKETS, skip_rates, step_summary
from ampwatch.server.rollups import ROLLUP_WIDTH


@dataclass(frozen=True)
class RunSample:
    """One run's values at scrape time; None where it has none (no step yet)."""

    run_id: int
    project: str
    name: str
    running: bool
    lag_seconds: float
    health: int
    steps: int
    last_step: int | None
    skipped_steps: int
    loss_scale: float | None
    skip_ratio: float | None
    dropped: dict[str, int]
    #: (rule, severity) -> firing alerts (one per layer for layer rules).
    firing: dict[tuple[str, str], int] = field(default_factory=dict)

    #: `project`, `run`, `run_id` as the exposition writes them, rendered once per scrape.
    label_text: str = ""


@dataclass(frozen=True)
class RunSamples:
    runs: list[RunSample]
    omitted: int


def _scraped_runs(now: datetime, ended_window: float, project: str | None) -> Select[Any]:
    """The ids of the runs `/metrics` covers, before the cap."""
    conditions = [
        or_(Run.status == "running", Run.last_seen_at >= now - timedelta(seconds=ended_window))
    ]
    if project is not None:
        conditions.append(Run.project == project)
    return select(Run.id).where(*conditions)


def collect(
    session: Session,
    *,
    now: datetime,
    ended_window: float,
    max_runs: int,
    project: str | None = None,
) -> RunSamples:
    """The runs `/metrics` covers (all projects when `project` is None), with their values.

    >>> collect(session, now=utcnow(), ended_window=3600, max_runs=2000)  # doctest: +SKIP
    RunSamples(runs=[RunSample(run_id=1, ...)], omitted=0)
    """
    if session.get_bind().dialect.name == "postgresql":
        # The skip ratios' 2,000 index-range subqueries are estimated above jit_above_cost;
        # compiling them took ~30 ms, longer than running them. This transaction only.
        session.execute(text("SET LOCAL jit = off"))
    candidates = _scraped_runs(now, ended_window, project)
    running_first = case((Run.status == "running", 0), else_=1)
    chosen = (
        candidates.order_by(running_first, Run.last_seen_at.desc(), Run.id.desc())
        .limit(max_runs)
        .cte("chosen")
    )
    ids = select(chosen.c.id)
    chosen_ids = ids
    summary, last_loss_scale = step_summary(chosen_ids)
    rows = session.execute(
        select(
            Run.id, Run.project, Run.name, Run.status, Run.last_seen_at, Run.health,
            *(getattr(Run, f"dropped_{kind}") for kind in DROPPED_KINDS),
            summary.c.steps, summary.c.last_step, summary.c.skipped_steps,
            last_loss_scale,
        )
        .outerjoin(summary, summary.c.run_id == Run.id)
        .where(Run.id.in_(ids))
        .order_by(Run.id)
    ).all()  # fmt: skip
    total = len(rows)
    if total == max_runs:  # the cap may have left some out
        total = session.scalar(select(func.count()).select_from(candidates.subquery())) or 0
    ratios = skip_rates(session, ids)
    firing: dict[int, dict[tuple[str, str], int]] = {}
    for run_id, rule, severity, count in session.execute(
        select(Alert.run_id, Alert.rule, Alert.severity, func.count())
        .where(Alert.status == "firing", Alert.run_id.in_(ids))
        .group_by(Alert.run_id, Alert.rule, Alert.severity)
    ):
        firing.setdefault(run_id, {})[(rule, severity)] = count
    runs = [_sample(row, now, ratios, firing) for row in rows]
    return RunSamples(runs=runs, omitted=max(0, total - len(runs)))


def _sample(
    row: Any,
    now: datetime,
    ratios: dict[int, float],
    firing: dict[int, dict[tuple[str, str], int]],
) -> RunSample:
    run_id, project, name, status, seen, health, *rest = row
    dropped = dict(zip(DROPPED_KINDS, rest[: len(DROPPED_KINDS)]))
    steps, last_step, skipped, scale = rest[len(DROPPED_KINDS) :]
    return RunSample(
        run_id=run_id,
        project=project,
        name=name,
        running=status == "running",
        lag_seconds=(now - seen).total_seconds(),
        health=HEALTHS.index(health),
        steps=int(steps or 0),
        last_step=last_step,
        skipped_steps=int(skipped or 0),
        loss_scale=scale,
        skip_ratio=ratios.get(run_id),
        dropped={kind: int(count or 0) for kind, count in dropped.items()},
        firing=firing.get(run_id, {}),
        label_text=render_labels({"project": project, "run": name, "run_id": str(run_id)}),
    )


Sample = tuple[str, float]
_DROPPED_LABELS = {kind: render_labels({"kind": kind}) for kind in DROPPED_KINDS}


@dataclass(frozen=True)
class Family:
    """A per-run series family: `samples(run)` gives its own labels (rendered text, empty
    for none) and values."""

    name: str
    kind: str
    help: str
    samples: Callable[[RunSample], list[Sample]]


def _value(get: Callable[[RunSample], float | None]) -> Callable[[RunSample], list[Sample]]:
    """A family with one sample per run, none where `get` is None."""
    return lambda run: [] if (value := get(run)) is None else [("", value)]


#: Every per-run family, in exposition order (labels project, run, run_id, then extras).
FAMILIES: tuple[Family, ...] = (
    Family("ampwatch_run_running", "gauge", "1 while the run is running, 0 once it ended.",
           _value(lambda run: int(run.running))),
    Family("ampwatch_run_lag_seconds", "gauge",
           "Seconds since a running run's last batch arrived (the age of its last data).",
           _value(lambda run: run.lag_seconds if run.running else None)),
    Family("ampwatch_run_loss_scale", "gauge",
           "The loss scale at the run's last step (absent before its first step).",
           _value(lambda run: run.loss_scale)),
    Family("ampwatch_run_last_step", "gauge", "The run's last optimizer step reported.",
           _value(lambda run: run.last_step)),
    Family("ampwatch_run_steps_total", "counter", "Optimizer steps the run reported.",
           _value(lambda run: run.steps)),
    Family("ampwatch_run_skipped_steps_total", "counter",
           "Optimizer steps the loss scaler skipped (Inf/NaN gradients).",
           _value(lambda run: run.skipped_steps)),
    Family("ampwatch_run_skip_ratio", "gauge",
           f"Skipped share of the run's last {SKIP_RATE_BUCKETS * ROLLUP_WIDTH:,} steps or "
           "fewer (the runs list's skip_rate).",
           _value(lambda run: run.skip_ratio)),
    Family("ampwatch_run_health", "gauge",
           "Worst firing alert's severity: 0 ok, 1 warning, 2 critical.",
           _value(lambda run: run.health)),
    Family("ampwatch_run_alerts_firing", "gauge",
           "Alerts firing for the run, by rule and severity (one per layer for layer rules).",
           lambda run: [(render_labels({"rule": rule, "severity": severity}), count)
                        for (rule, severity), count in sorted(run.firing.items())]),
    Family("ampwatch_run_agent_dropped_total", "counter",
           "Records the run's agent dropped rather than block training, by kind.",
           lambda run: [(_DROPPED_LABELS[kind], count) for kind, count in run.dropped.items()]),
)  # fmt: skip


def family_samples(family: Family, runs: list[RunSample]) -> Iterator[tuple[str, float]]:
    """`family`'s samples over `runs` as (label text, value): each run's labels, rendered
    once per run, then the family's own."""
    for run in runs:
        own = run.label_text
        for extra, value in family.samples(run):
            yield (f"{own},{extra}" if extra else own), value
