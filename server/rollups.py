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

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Integer, case, func, literal, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import STEP_FLOAT_FIELDS
from ampwatch.server.db import dialect_insert
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


def level_rows(session: Session, level: int, *where: Any) -> Any:
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
    statement = dialect_insert(session, StepRollupLevel).from_select(columns, rows)
    return statement.on_conflict_do_update(
        index_elements=["run_id", "rank", "level", "bucket_start"],
        set_={name: statement.excluded[name] for name in (*ROLLUP_COLUMNS, "step_count")},
    )


def refresh_step_rollups(
    session: Session, run_id: int, spans: Iterable[tuple[int, int, int]]
) -> None:
    """Recompute the rollups covering steps `first..last` of `rank`, per (rank, first, last),
    and move the run's `run_step_totals` by what the recomputed rollups changed.

    >>> refresh_step_rollups(session, run.id, [(0, 1, 2000)])  # doctest: +SKIP
    """
    for rank, first, last in spans:
        low = first // ROLLUP_WIDTH * ROLLUP_WIDTH
        high = last // ROLLUP_WIDTH * ROLLUP_WIDTH + ROLLUP_WIDTH - 1
        counted = select(
            func.coalesce(func.sum(StepRollup.step_count), 0),
            func.coalesce(func.sum(StepRollup.skipped_count), 0),
        ).where(
            StepRollup.run_id == run_id,
            StepRollup.rank == rank,
            StepRollup.bucket_start.between(low, high),
        )
        steps_before, skipped_before = session.execute(counted).one()
        bucket = (Step.step // ROLLUP_WIDTH) * ROLLUP_WIDTH
        recomputed = (
            select(Step.run_id, Step.rank, bucket, *step_aggregates(), func.count())
            .where(Step.run_id == run_id, Step.rank == rank, Step.step.between(low, high))
            .group_by(Step.run_id, Step.rank, bucket)
        )
        statement = dialect_insert(session, StepRollup).from_select(
            ["run_id", "rank", "bucket_start", *ROLLUP_COLUMNS, "step_count"], recomputed
        )
        session.execute(
            statement.on_conflict_do_update(
                index_elements=["run_id", "rank", "bucket_start"],
                set_={name: statement.excluded[name] for name in (*ROLLUP_COLUMNS, "step_count")},
            )
        )
        for level in LAYER_LEVELS[1:]:
            source, _ = level_source(level // LEVEL_FACTOR)
            session.execute(
                level_rows(
                    session,
                    level,
                    source.run_id == run_id,
                    source.rank == rank,
                    source.bucket_start.between(
                        first // level * level, last // level * level + level - 1
                    ),
                )
            )
        steps_after, skipped_after = session.execute(counted).one()
        _add_totals(session, run_id, rank, steps=int(steps_after - steps_before),
                    skipped=int(skipped_after - skipped_before), last_step=last)  # fmt: skip


def _add_totals(
    session: Session, run_id: int, rank: int, *, steps: int, skipped: int, last_step: int
) -> None:
    """Add to a (run, rank)'s totals, created at the first batch; its last step only rises
    (steps are never deleted apart from their run). The caller holds the run's lock."""
    insert = dialect_insert(session, RunStepTotals).values(
        run_id=run_id, rank=rank, steps=steps, skipped_steps=skipped, last_step=last_step
    )
    table = RunStepTotals.__table__.c
    session.execute(
        insert.on_conflict_do_update(
            index_elements=["run_id", "rank"],
            set_={
                "steps": table.steps + insert.excluded.steps,
                "skipped_steps": table.skipped_steps + insert.excluded.skipped_steps,
                "last_step": case(
                    (insert.excluded.last_step > table.last_step, insert.excluded.last_step),
                    else_=table.last_step,
                ),
            },
        )
    )
