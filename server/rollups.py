"""Step rollups: min, max and skip count of every step field per `ROLLUP_WIDTH` steps, and
activation_norm_spike's threshold (min, max, steps judged above: `THRESHOLD_COLUMNS`).

Written by ingest (`refresh_step_rollups`, in the batch's transaction, after the rule
engine wrote its per-step thresholds onto the steps), read by the
downsampled step series (`ampwatch.server.series`). A rollup row is always recomputed
whole, never merged incrementally, so a step re-sent with a new value cannot leave a stale
extreme behind, and NaN ordering is the database's own (NaN above every number, in SQLite
as the text 'NaN' and in PostgreSQL natively) on the raw and the rolled-up path alike.

The levels: `step_rollup_levels` holds the finest (`FINE_LEVEL`, 16 steps, recomputed from
the raw steps of its bucket); the 64-step rollups of `step_rollups` come from it, and the
coarser levels of the layer rollups (`LAYER_LEVELS`: 256 .. 65,536 steps, by 4, in
`step_rollup_levels` again) each from the level below, every bucket the batch touched
recomputed in the same transaction from the level below's buckets: min of minima,
max of maxima and sums of counts compose, so every level equals a direct aggregation of
the raw steps, and a whole-run series, or a zoomed window, reads a bounded number of rows
at any run length (`plan_reads`, shared with the layer rollups).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Integer, bindparam, case, delete, func, literal, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import STEP_FLOAT_FIELDS
from ampwatch.server.db import insert_for
from ampwatch.server.layer_rollups import FINEST, LAYER_LEVELS, LEVEL_FACTOR
from ampwatch.server.step_models import RunStepTotals, Step, StepRollup, StepRollupLevel

#: Steps per rollup bucket of `step_rollups`. 100k steps become ~1,600 rollup rows; a
#: batch of the agent's (up to 2,000 records) touches a few dozen buckets.
ROLLUP_WIDTH = FINEST
#: A level under the layer rollups' finest, for the step series only (layer samples come
#: every ~10 steps): a zoomed window of 16,000-64,000 steps read its raw steps, ~40,000
#: of them (74 ms on SQLite at 50,000), and now reads at most ~2,000 of these.
FINE_LEVEL = FINEST // LEVEL_FACTOR
#: The step rollups' levels, finest first (`plan_reads`' `levels` for the step series).
STEP_LEVELS: tuple[int, ...] = (FINE_LEVEL, *LAYER_LEVELS)

#: The extremes of every step field and the skip count, in table order after the key.
EXTREME_COLUMNS: tuple[str, ...] = (
    "first_step",
    "last_step",
    "skipped_count",
    *(f"{field}_{extreme}" for field in STEP_FLOAT_FIELDS for extreme in ("min", "max")),
)

#: `activation_norm_spike`'s threshold per bucket (0013): its extremes and the steps judged
#: above it, from `Step.act_threshold` / `act_above` (written by the rule engine).
THRESHOLD_COLUMNS: tuple[str, ...] = ("act_threshold_min", "act_threshold_max", "act_above_count")

#: Every rollup column after the key.
ROLLUP_COLUMNS: tuple[str, ...] = EXTREME_COLUMNS + THRESHOLD_COLUMNS


def _raw_aggregate(name: str) -> Any:
    if name in ("first_step", "last_step"):
        return (func.min if name == "first_step" else func.max)(Step.step)
    if name.endswith("_count"):
        flag = Step.skipped if name == "skipped_count" else Step.act_above.is_(True)
        return func.sum(case((flag, 1), else_=0), type_=Integer)
    field, extreme = name.rsplit("_", 1)
    return (func.min if extreme == "min" else func.max)(getattr(Step, field))


def step_aggregates(columns: tuple[str, ...] = ROLLUP_COLUMNS) -> list[Any]:
    """SELECT expressions aggregating raw steps into the order of `columns`."""
    return [_raw_aggregate(name) for name in columns]


def rollup_aggregates(
    source: type[StepRollup | StepRollupLevel], columns: tuple[str, ...] = ROLLUP_COLUMNS
) -> list[Any]:
    """SELECT expressions combining rollup rows of `source` into `columns` order: minima
    of minima, maxima of maxima, sums of counts, so every level equals the raw steps'."""
    combined: list[Any] = []
    for name in columns:
        column = getattr(source, name)
        if name.endswith("_count"):
            combined.append(func.sum(column))
        elif name.endswith("_min") or name == "first_step":
            combined.append(func.min(column))
        else:
            combined.append(func.max(column))
    return combined


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
            source.run_id, source.rank, *_level_key(level), bucket,
            *rollup_aggregates(source), func.sum(source.step_count),
        )
        .where(*of_level, *where)
        .group_by(source.run_id, source.rank, bucket)
    )  # fmt: skip
    return _upsert_rows(dialect, level, rows)


def fine_rows(dialect: str, *where: Any) -> Any:
    """An INSERT .. SELECT upserting the `FINE_LEVEL` rollups of the raw steps that match
    `where` (ingest's refresh; migration 0014 holds a frozen copy as of its revision)."""
    bucket = (Step.step // FINE_LEVEL) * FINE_LEVEL
    rows = (
        select(
            Step.run_id, Step.rank, *_level_key(FINE_LEVEL), bucket,
            *step_aggregates(), func.count(),
        )
        .where(*where)
        .group_by(Step.run_id, Step.rank, bucket)
    )  # fmt: skip
    return _upsert_rows(dialect, FINE_LEVEL, rows)


def _level_key(level: int) -> list[Any]:
    """The `level` column's value for a level's rows (`step_rollups` has no such column)."""
    return [] if level == ROLLUP_WIDTH else [literal(level, Integer)]


def _upsert_rows(dialect: str, level: int, rows: Any) -> Any:
    """`rows` (run, rank, [level,] bucket start, `ROLLUP_COLUMNS`, step count) upserted
    into the table of `level` (`level_source`)."""
    columns = ROLLUP_COLUMNS
    table, _ = level_source(level)
    key = ["run_id", "rank", *(["level"] if _level_key(level) else []), "bucket_start"]
    statement = insert_for(dialect, table).from_select([*key, *columns, "step_count"], rows)
    return statement.on_conflict_do_update(
        index_elements=key,
        set_={name: statement.excluded[name] for name in (*columns, "step_count")},
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
    fine: Any
    finest: Any
    levels: tuple[tuple[int, Any], ...]
    totals: Any
    #: After deleted steps: each level's rows in the span, dropped before the recompute (an
    #: emptied bucket has no rows to recompute it from), and the totals with the last step
    #: set rather than raised.
    drops: tuple[tuple[int, Any], ...]
    lowered: Any


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
    in_span = (Step.run_id == run_id, Step.rank == rank, Step.step.between(low, high))
    fine = fine_rows(dialect, *in_span)
    # From the fine level just refreshed over the same whole 64-step buckets: a quarter of
    # the rows that aggregating the raw steps again would read.
    finest = level_rows(
        dialect,
        ROLLUP_WIDTH,
        StepRollupLevel.run_id == run_id,
        StepRollupLevel.rank == rank,
        StepRollupLevel.bucket_start.between(low, high),
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
    added = {
        "steps": table.steps + totals.excluded.steps,
        "skipped_steps": table.skipped_steps + totals.excluded.skipped_steps,
    }
    # Steps are deleted only as a resume's abandoned tail (`lowered`), so otherwise a
    # (run, rank)'s last step only rises.
    lowered = totals.on_conflict_do_update(
        index_elements=["run_id", "rank"], set_={**added, "last_step": totals.excluded.last_step}
    )
    totals = totals.on_conflict_do_update(
        index_elements=["run_id", "rank"],
        set_={
            **added,
            "last_step": case(
                (totals.excluded.last_step > table.last_step, totals.excluded.last_step),
                else_=table.last_step,
            ),
        },
    )
    drops = []
    for level in (FINE_LEVEL, ROLLUP_WIDTH, *LAYER_LEVELS[1:]):
        source, of_level = level_source(level)
        drops.append(
            (
                level,
                delete(source).where(
                    *of_level,
                    source.run_id == run_id,
                    source.rank == rank,
                    source.bucket_start.between(low, high),
                ),
            )
        )
    return _Refresh(counted, fine, finest, tuple(levels), totals, tuple(drops), lowered)


def refresh_step_rollups(
    session: Session,
    run_id: int,
    spans: Iterable[tuple[int, int, int]],
    *,
    deleted: bool = False,
) -> None:
    """Recompute the rollups covering steps `first..last` of `rank`, per (rank, first, last),
    and move the run's `run_step_totals` (created at the first batch; the caller holds the
    run's lock) by what the recomputed rollups changed. `deleted`: the spans' steps were
    deleted (a resume's abandoned tail, `ampwatch.server.rollback`): their rollup rows are
    dropped and recomputed from what is left, and the rank's last step falls to `first - 1`.

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
        if deleted:  # the same bucket ranges the recompute below covers, level by level
            for level, statement in statements.drops:
                aligned = level if level > ROLLUP_WIDTH else ROLLUP_WIDTH
                connection.execute(statement, {**span, **_bounds(first, last, aligned)})
        connection.execute(statements.fine, span)
        connection.execute(statements.finest, span)
        for level, statement in statements.levels:
            connection.execute(statement, {**span, **_bounds(first, last, level)})
        steps_after, skipped_after = connection.execute(statements.counted, span).one()
        totals = {
            "run_id": run_id,
            "rank": rank,
            "steps": int(steps_after - steps_before),
            "skipped": int(skipped_after - skipped_before),
            "last_step": first - 1 if deleted else last,
        }
        connection.execute(statements.lowered if deleted else statements.totals, totals)


def _bounds(first: int, last: int, level: int) -> dict[str, int]:
    """The whole `level`-step buckets covering steps `first..last`."""
    return {"low": first // level * level, "high": last // level * level + level - 1}
