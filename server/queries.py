"""Read-side queries behind the `/api/v1/runs` endpoints, returning response models."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, ScalarSelect, Select, Subquery, bindparam, func, select
from sqlalchemy.orm import Session, aliased

from ampwatch.agent.wire import DROPPED_KINDS, encode_float
from ampwatch.server.models import Event, Health, Run, RunStatus
from ampwatch.server.rollups import ROLLUP_WIDTH
from ampwatch.server.schemas.runs import EventPublic, EventsPublic, RunPublic, RunsPublic
from ampwatch.server.step_models import RunStepTotals, Step, StepRollup

#: The runs list's `skip_rate` covers the last this many step rollups of each run (1,024
#: steps at `ROLLUP_WIDTH` 64): recent enough to show a skip storm now, read from a few
#: rollup rows per run instead of the run's steps.
SKIP_RATE_BUCKETS = 16


def step_summary(run_ids: Select[Any] | None = None) -> tuple[Subquery, ScalarSelect[Any]]:
    """Each run's `steps`, `last_step` and `skipped_steps` (a subquery keyed by `run_id`)
    and its last loss scale (a scalar subquery correlated with `Run`), for the runs
    `run_ids` selects (every run when None).

    From `run_step_totals`, a row per rank that ingest keeps (summing the step rollups
    scanned a run's whole length on every list, run page refresh and scrape). The rank
    that reported most, so steps count once however many ranks reported them (ranks
    share skips: one scaler decision).
    """
    query = select(
        RunStepTotals.run_id,
        func.max(RunStepTotals.steps).label("steps"),
        func.max(RunStepTotals.last_step).label("last_step"),
        func.max(RunStepTotals.skipped_steps).label("skipped_steps"),
    )
    if run_ids is not None:
        query = query.where(RunStepTotals.run_id.in_(run_ids))
    summary = query.group_by(RunStepTotals.run_id).subquery()
    # The run's ranks from `run_step_totals`, so each is a primary-key lookup of (run,
    # rank, step): by (run, step) alone SQLite scanned every step of the run (the runs
    # list took 107 ms with one run of 500k steps, 16 ms at 100k).
    ranks = aliased(RunStepTotals)
    last_loss_scale = (
        select(Step.loss_scale)
        .where(
            Step.run_id == Run.id,
            Step.rank.in_(select(ranks.rank).where(ranks.run_id == Run.id).correlate(Run)),
            Step.step == summary.c.last_step,
        )
        .order_by(Step.rank)
        .limit(1)
        .scalar_subquery()
    )
    return summary, last_loss_scale


def skip_rates(session: Session, run_ids: list[int] | Select[Any]) -> dict[int, float]:
    """Skipped share over each run's last `SKIP_RATE_BUCKETS` rollups (one query), for the
    runs listed or selected by `run_ids`: an index range of each rank's last rollups,
    found from its `run_step_totals.last_step`, whatever the run's length."""
    if isinstance(run_ids, list):
        if not run_ids:
            return {}
        rows = session.execute(_listed_skip_rates(), {"run_ids": run_ids})
    else:
        rows = session.execute(_skip_rates_query(run_ids))
    # float(): PostgreSQL sums bigints as numeric (Decimal).
    return {
        run_id: float(skipped or 0) / float(counted) for run_id, skipped, counted in rows if counted
    }


@functools.cache
def _listed_skip_rates() -> Select[Any]:
    """`skip_rates`' query for a list of ids (`run_ids`, an expanding parameter), built
    once: building its subqueries was ~half the runs list's CPU (3.5 of 6.8 ms a request,
    8 runs), the database's work a small part of it."""
    return _skip_rates_query(bindparam("run_ids", expanding=True))


#: The run's columns a `RunPublic` shows, selected as columns, not `Run` objects: under
#: `bench/load.py` building and reading the objects took ~14 points of the runs list's 24%
#: of the serving process's GIL time (py-spy --gil); in-process, one list of 32 runs at a
#: time, 1,040 -> 1,000 us of CPU.
_RUN_COLUMNS = (
    Run.id,
    Run.client_run_id,
    Run.name,
    Run.project,
    Run.status,
    Run.created_at,
    Run.last_seen_at,
    Run.health,
    *(getattr(Run, f"dropped_{kind}") for kind in DROPPED_KINDS),
)


@functools.cache
def _runs_query() -> Select[Any]:
    """Runs with their step summaries (`step_summary`), newest first; built once, as
    `_listed_skip_rates`, and narrowed per request with `.where`."""
    summary, last_loss_scale = step_summary()
    return (
        select(
            *_RUN_COLUMNS,
            summary.c.steps,
            summary.c.last_step,
            summary.c.skipped_steps,
            last_loss_scale.label("last_loss_scale"),
        )
        .outerjoin(summary, summary.c.run_id == Run.id)
        .order_by(Run.created_at.desc(), Run.id.desc())
    )


def _skip_rates_query(run_ids: Any) -> Select[Any]:
    # The run's latest rollup over all ranks starts at its last step's bucket; each rank's
    # rollups from 15 buckets before it are an index range (run_id, rank, bucket_start),
    # read by correlated subqueries: as a join, PostgreSQL hashed every rollup of the runs
    # (157k rows for 1,000 runs of 10k steps, ~50 ms) and SQLite searched by run_id alone.
    others = aliased(RunStepTotals)
    run_last = select(func.max(others.last_step)).where(others.run_id == RunStepTotals.run_id)
    window = (SKIP_RATE_BUCKETS - 1) * ROLLUP_WIDTH
    cutoffs = (
        select(
            RunStepTotals.run_id,
            RunStepTotals.rank,
            (run_last.scalar_subquery() // ROLLUP_WIDTH * ROLLUP_WIDTH - window).label("cutoff"),
        )
        .where(RunStepTotals.run_id.in_(run_ids))
        # A no-op on the primary key that keeps the cutoff computed once per rank (both
        # databases materialise a grouped subquery rather than inline it per use).
        .group_by(RunStepTotals.run_id, RunStepTotals.rank)
        .subquery()
    )
    recent = (
        StepRollup.run_id == cutoffs.c.run_id,
        StepRollup.rank == cutoffs.c.rank,
        StepRollup.bucket_start >= cutoffs.c.cutoff,
    )
    per_rank = select(
        cutoffs.c.run_id,
        select(func.sum(StepRollup.skipped_count))
        .where(*recent)
        .scalar_subquery()
        .label("skipped"),
        select(func.sum(StepRollup.step_count)).where(*recent).scalar_subquery().label("counted"),
    ).subquery()
    return select(
        per_rank.c.run_id, func.sum(per_rank.c.skipped), func.sum(per_rank.c.counted)
    ).group_by(per_rank.c.run_id)


def _run_public(row: Sequence[Any], *, skip_rate: float | None = None) -> RunPublic:
    """A row of `_runs_query` (`_RUN_COLUMNS`, then the summary's four) as the API shows
    it, unpacked by position: reading a Row's fields by name, and the dict of dropped
    counts, took 6.4 points of the runs list's 18.9% of the serving process's GIL time
    under `bench/load.py` (py-spy --gil); in-process, 32 runs: 1,000 -> 870 us a list."""
    id_, client_run_id, name, project, status, created_at, last_seen_at, health, *rest = row
    *dropped, steps, last_step, skipped_steps, last_loss_scale = rest
    return RunPublic(
        id=id_,
        client_run_id=client_run_id,
        name=name,
        project=project,
        status=status,
        created_at=created_at,
        last_seen_at=last_seen_at,
        steps=steps or 0,
        last_step=last_step,
        last_loss_scale=encode_float(last_loss_scale),
        skipped_steps=skipped_steps or 0,
        health=health,
        skip_rate=skip_rate,
        dropped=dict(zip(DROPPED_KINDS, dropped, strict=True)),
    )


def list_runs(
    session: Session,
    *,
    project: str | None = None,
    status: RunStatus | None = None,
    health: Health | None = None,
    name_contains: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> RunsPublic:
    """One page of the runs matching every given filter, newest first, with the total.

    `name_contains` matches anywhere in the name, case-insensitively (ASCII case on SQLite).
    """
    params: dict[str, Any] = {"project": project, "status": status, "health": health}
    params = {name: value for name, value in params.items() if value is not None}
    if name_contains:
        pattern = name_contains.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        params["name"] = f"%{pattern}%"
    count, page_query = _runs_page(tuple(sorted(params)))
    total = session.scalar(count, params) or 0
    page = session.execute(page_query, {**params, "limit": limit, "offset": offset}).all()
    rates = skip_rates(session, [row.id for row in page])
    return RunsPublic(
        runs=[_run_public(row, skip_rate=rates.get(row.id)) for row in page],
        total=total,
        limit=limit,
        offset=offset,
    )


@functools.cache
def _runs_page(filters: tuple[str, ...]) -> tuple[Select[Any], Select[Any]]:
    """The runs list's count and page queries for the filters given (`list_runs`' names,
    bound by name with the page's `limit` and `offset`), built once per combination."""
    conditions: list[ColumnElement[bool]] = [
        getattr(Run, name) == bindparam(name)
        for name in ("project", "status", "health")
        if name in filters
    ]
    if "name" in filters:
        conditions.append(Run.name.ilike(bindparam("name"), escape="\\"))
    count = select(func.count()).select_from(Run).where(*conditions)
    page = _runs_query().where(*conditions).limit(bindparam("limit")).offset(bindparam("offset"))
    return count, page


@functools.cache
def _run_by_id() -> Select[Any]:
    return _runs_query().where(Run.id == bindparam("run_id"))


def get_run(session: Session, run_id: int) -> RunPublic | None:
    """One run with its step summary, or None when there is no such run."""
    row = session.execute(_run_by_id(), {"run_id": run_id}).first()
    return _run_public(row, skip_rate=skip_rates(session, [run_id]).get(run_id)) if row else None


def run_events(session: Session, run_id: int) -> EventsPublic:
    """A run's events in time order (ties in arrival order)."""
    events = session.scalars(
        select(Event).where(Event.run_id == run_id).order_by(Event.time, Event.id)
    )
    return EventsPublic(
        events=[
            EventPublic(kind=e.kind, step=e.step, time=e.time.timestamp(), data=e.data)
            for e in events
        ]
    )
