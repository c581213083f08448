"""Step rollups: min, max and skip count of every step field per `ROLLUP_WIDTH` steps.

Written by ingest (`refresh_step_rollups`, in the batch's transaction), read by the
downsampled step series (`ampwatch.server.series`). A rollup row is always recomputed from
the raw `steps` rows of its bucket, never merged incrementally, so a step re-sent with a
new value cannot leave a stale extreme behind, and NaN ordering is the database's own
(NaN above every number, in SQLite as the text 'NaN' and in PostgreSQL natively) on the
raw and the rolled-up path alike.

Above the 64-step rollups, `step_rollup_levels` holds the coarser levels of the layer
rollups (`LAYER_LEVELS`: 256 .. 65,536 steps, by 4), each bucket recomputed in the same
transaction from the buckets of the level below it that the batch touched: min of minima,
max of maxima and sums of counts compose, so every level equals a direct aggregation of
the raw steps, and a whole-run series reads a bounded number of rows at any run length
(`plan_reads`, shared with the layer rollups).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Integer, bindparam, case, func, literal, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import STEP_FLOAT_FIELDS
from ampwatch.server.db import insert_for
from ampwatch.server.layer_rollups import FINEST, LAYER_LEVELS, LEVEL_FACTOR
from ampwatch.server.models import RunStepTotals, Step, StepRollup, StepRollupLevel

#: Steps per rollup bucket (the finest level). 100k steps become ~1,600 rollup rows; a
#: batch of the agent's (up to 2,000 records) touches a few dozen buckets.
ROLLUP_WIDTH = FINEST

#: Rollup columns in table order after the key, as (name, aggregate over raw steps).
ROLLUP_COLUMNS: tuple[str, ...] = (
    "first_step",
    "last_step",
    "skipped_count",
    *(f"{field}_{extreme}" for field in STEP_FLOAT_FIELDS for extreme in ("min", "max")),
)


def step_aggregates() -> list[Any]:
    """SELECT expressions aggregating raw steps into the order of `ROLLUP_COLUMNS`."""
    columns: list[Any] = [
        func.min(Step.step),
        func.max(Step.step),
        func.sum(case((Step.skipped, 1), else_=0), type_=Integer),
    ]
    for field in STEP_FLOAT_FIELDS:
        column = getattr(Step, field)
        columns += [func.min(column), func.max(column)]
    return columns


def rollup_aggregates(source: type[StepRollup | StepRollupLevel]) -> list[Any]:
    """SELECT expressions combining rollup rows of `source` into `ROLLUP_COLUMNS` order."""
    columns: list[Any] = [
        func.min(source.first_step),
        func.max(source.last_step),
        func.sum(source.skipped_count),
    ]
    for name in ROLLUP_COLUMNS[3:]:
        column = getattr(source, name)
        columns.append(func.min(column) if name.endswith("_min") else func.max(column))
    return columns


def level_source(level: int) -> tuple[type[StepRollup | StepRollupLevel], list[Any]]:
    """The table holding rollups of `level` steps, and the WHERE terms choosing them."""
    if level == ROLLUP_WIDTH:
        return StepRollup, []
    return StepRollupLevel, [StepRollupLevel.level == level]


def level_rows(dialect: str, level: int, *where: Any) -> Any:
    """An INSERT .. SELECT upserting the `level`-step rollups from the level below's rows
    that match `where` (terms on the below level's table, given by `level_source`)."""
    source, of_level = level_source(level // LEVEL_FACTOR)
    bucket = (source.bucket_start // level) * level
    rows = (
        select(
            source.run_id, source.rank, literal(level, Integer), bucket,
            *rollup_aggregates(source), func.sum(source.step_count),
        )
        .where(*of_level, *where)
        .group_by(source.run_id, source.rank, bucket)
    )  # fmt: skip
    columns = ["run_id", "rank", "level", "bucket_start", *ROLLUP_COLUMNS, "step_count"]
    statement = insert_for(dialect, StepRollupLevel).from_select(columns, rows)
    return statement.on_conflict_do_update(
        index_elements=["run_id", "rank", "level", "bucket_start"],
        set_={name: statement.excluded[name] for name in (*ROLLUP_COLUMNS, "step_count")},
    )


def _param(name: str) -> Any:
    return bindparam(name, type_=BigInteger)


@dataclass(frozen=True)
class _Refresh:
    """`refresh_step_rollups`' statements, bound by name (`run_id`, `rank`, `low`, `high`;
    the totals' `steps`, `skipped`, `last_step`). Built once per dialect: building them
    per batch (the upserts' `excluded` column collections above all) was ~25 ms of a
    layer-heavy batch's ~110, against ~3 ms of SQL."""

    counted: Any
    finest: Any
    levels: tuple[tuple[int, Any], ...]
    totals: Any


@functools.cache
def _refresh_statements(dialect: str) -> _Refresh:
    run_id, rank, low, high = (_param(name) for name in ("run_id", "rank", "low", "high"))
    counted = select(
        func.coalesce(func.sum(StepRollup.step_count), 0),
        func.coalesce(func.sum(StepRollup.skipped_count), 0),
    ).where(
        StepRollup.run_id == run_id,
        StepRollup.rank == rank,
        StepRollup.bucket_start.between(low, high),
    )
    bucket = (Step.step // ROLLUP_WIDTH) * ROLLUP_WIDTH
    recomputed = (
        select(Step.run_id, Step.rank, bucket, *step_aggregates(), func.count())
        .where(Step.run_id == run_id, Step.rank == rank, Step.step.between(low, high))
        .group_by(Step.run_id, Step.rank, bucket)
    )
    statement = insert_for(dialect, StepRollup).from_select(
        ["run_id", "rank", "bucket_start", *ROLLUP_COLUMNS, "step_count"], recomputed
    )
    finest = statement.on_conflict_do_update(
        index_elements=["run_id", "rank", "bucket_start"],
        set_={name: statement.excluded[name] for name in (*ROLLUP_COLUMNS, "step_count")},
    )
    levels = []
    for level in LAYER_LEVELS[1:]:
        source, _ = level_source(level // LEVEL_FACTOR)
        where = (
            source.run_id == run_id,
            source.rank == rank,
            source.bucket_start.between(low, high),
        )
        levels.append((level, level_rows(dialect, level, *where)))
    totals = insert_for(dialect, RunStepTotals).values(
        run_id=run_id, rank=rank, steps=_param("steps"),
        skipped_steps=_param("skipped"), last_step=_param("last_step"),
    )  # fmt: skip
    table = RunStepTotals.__table__.c
    # Steps are never deleted apart from their run, so a (run, rank)'s last step only rises.
    totals = totals.on_conflict_do_update(
        index_elements=["run_id", "rank"],
        set_={
            "steps": table.steps + totals.excluded.steps,
            "skipped_steps": table.skipped_steps + totals.excluded.skipped_steps,
            "last_step": case(
                (totals.excluded.last_step > table.last_step, totals.excluded.last_step),
                else_=table.last_step,
            ),
        },
    )
    return _Refresh(counted, finest, tuple(levels), totals)


def refresh_step_rollups(
    session: Session, run_id: int, spans: Iterable[tuple[int, int, int]]
) -> None:
    """Recompute the rollups covering steps `first..last` of `rank`, per (rank, first, last),
    and move the run's `run_step_totals` (created at the first batch; the caller holds the
    run's lock) by what the recomputed rollups changed.

    >>> refresh_step_rollups(session, run.id, [(0, 1, 2000)])  # doctest: +SKIP
    """
    statements = _refresh_statements(session.get_bind().dialect.name)
    # Core execution: given parameters, an ORM-enabled INSERT would be a bulk insert.
    connection = session.connection()
    for rank, first, last in spans:
        low = first // ROLLUP_WIDTH * ROLLUP_WIDTH
        span = {
            "run_id": run_id,
            "rank": rank,
            "low": low,
            "high": last // ROLLUP_WIDTH * ROLLUP_WIDTH + ROLLUP_WIDTH - 1,
        }
        steps_before, skipped_before = connection.execute(statements.counted, span).one()
        connection.execute(statements.finest, span)
        for level, statement in statements.levels:
            connection.execute(
                statement,
                {**span, "low": first // level * level, "high": last // level * level + level - 1},
            )
        steps_after, skipped_after = connection.execute(statements.counted, span).one()
        totals = {
            "run_id": run_id,
            "rank": rank,
            "steps": int(steps_after - steps_before),
            "skipped": int(skipped_after - skipped_before),
            "last_step": last,
        }
        connection.execute(statements.totals, totals)
