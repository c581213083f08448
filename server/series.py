"""Downsampled reads of long runs: the method, and the step series (the layers x steps
matrix and one layer's series follow it in `ampwatch.server.layer_reads`).

Answers are built with `model_construct` (the values are ours, already in the wire
encoding) and written with orjson by the endpoints: validating 250,000 heatmap cells
through a union type cost more than the query itself.

Method: min/max per bucket, not LTTB. The runs we watch fail in single steps -- one NaN
loss, one overflow that halves the scale, one layer frozen for a stretch -- and a chart
must show every one of them however far it is zoomed out. Min/max keeps each bucket's
extremes exactly (every spike and dip is in the answer, equal to a direct computation),
is the same reduction in SQL, in the rollups and in numpy, and composes: the min of
rollup minima is the minimum. LTTB keeps one point per bucket chosen for visual area, so
of two opposite spikes in one bucket one is lost, and what it keeps cannot be checked
against a simple formula.

Buckets are aligned to multiples of `bucket_width` steps (bucket = step // width), so a
bucket's content does not depend on where a zoom window starts, and each bucket becomes
two points: (its first step, every field's minimum) and (its last step, every field's
maximum); a bucket holding one step stays one point. NaN counts as the maximum (it sorts
above every number in both databases) and is ignored by the minimum unless the bucket
holds nothing else: a NaN always shows. A skipped step marks its bucket's first point
(`skipped`), and `skipped_count` says how many steps each point stands for, so totals
and every skip survive any downsampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import STEP_FLOAT_FIELDS, WireFloat, encode_float, encode_floats
from ampwatch.server.layer_rollups import Piece, plan_reads
from ampwatch.server.rollups import STEP_LEVELS, level_source, rollup_aggregates, step_aggregates
from ampwatch.server.schemas.runs import StepSeries
from ampwatch.server.step_models import Step


@dataclass
class _Bucket:
    first: int
    last: int
    skipped: int
    extremes: list[float | None]  # per STEP_FLOAT_FIELDS: min, max, min, max, ...
    threshold: list[float | None]  # activation_norm_spike's: min, max
    above: int  # steps judged above it

    @property
    def drawn_threshold(self) -> float | None:
        """The bucket's line: its minimum threshold where a step was above it, else its
        maximum. Against the bucket's maximum value (its second point) that is exact both
        ways: a step above its threshold is above every smaller one, so the point is above
        the line; with none above, every value is at most its own threshold, so the maximum
        is at most the largest. A single minimum or maximum would draw steps as above that
        the rule judged below, or the reverse. (A bucket whose maximum is NaN draws a gap
        there: NaN wins the maximum, and the rule never judges a non-finite norm.)"""
        return self.threshold[0] if self.above else self.threshold[1]


def _nan_min(a: float | None, b: float | None) -> float | None:
    if a is None or (math.isnan(a) and b is not None):
        return b
    if b is None or math.isnan(b):
        return a
    return min(a, b)


def _nan_max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _merge(buckets: dict[int, _Bucket], rows: Any) -> None:
    """Add rows of (key, *ROLLUP_COLUMNS) into their buckets."""
    for key, first, last, skipped, *extremes, low, high, above in rows:
        old = buckets.get(key)
        if old is None:
            buckets[key] = _Bucket(first, last, skipped or 0, list(extremes), [low, high],
                                   above or 0)  # fmt: skip
            continue
        old.first, old.last = min(old.first, first), max(old.last, last)
        old.skipped += skipped or 0
        old.above += above or 0
        for i, value in enumerate(extremes):
            merge = _nan_min if i % 2 == 0 else _nan_max
            old.extremes[i] = merge(old.extremes[i], value)
        old.threshold = [_nan_min(old.threshold[0], low), _nan_max(old.threshold[1], high)]


def _step_bounds(
    session: Session, run_id: int, rank: int, start: int | None, end: int | None
) -> tuple[int, int] | None:
    # Two scalar subqueries, not min() and max() in one SELECT: SQLite answers a lone
    # min or max from the index end, both together by scanning every row (9 ms at 100k).
    of_rank = (Step.run_id == run_id, Step.rank == rank)
    low, high = session.execute(
        select(
            select(func.min(Step.step)).where(*of_rank).scalar_subquery(),
            select(func.max(Step.step)).where(*of_rank).scalar_subquery(),
        )
    ).one()
    if low is None:
        return None
    low, high = max(low, start or 0), high if end is None else min(high, end)
    return (low, high) if low <= high else None


def bucket_width_for(low: int, high: int, buckets: int) -> int:
    """Steps per bucket so that steps low..high fall in at most `buckets` buckets aligned
    to multiples of the width (a read of rollups widens it to a multiple of their level:
    `plan_reads`).

    Aligned buckets can straddle both ends of the range, so the width must cover
    (high - low) / (buckets - 1) steps, not (high - low + 1) / buckets.

    >>> bucket_width_for(1, 100_000, 250)
    402
    """
    return high + 1 if buckets <= 1 else (high - low) // (buckets - 1) + 1


def step_series(
    session: Session,
    run_id: int,
    rank: int,
    *,
    start: int | None = None,
    end: int | None = None,
    max_points: int,
) -> StepSeries:
    """One rank's steps in [start, end] as columns, min/max-downsampled to <= max_points."""
    bounds = _step_bounds(session, run_id, rank, start, end)
    if bounds is None:
        return _columns([], 1)
    low, high = bounds
    in_range = (Step.run_id == run_id, Step.rank == rank, Step.step.between(low, high))
    if high - low + 1 <= max_points:
        bucket: Any = Step.step
        rows = session.execute(
            select(bucket, *step_aggregates()).where(*in_range).group_by(bucket).order_by(bucket)
        )
        groups = session.execute(
            select(Step.step, Step.lr_groups).where(*in_range, Step.lr_groups.is_not(None))
        )
        lr_groups = {step: _wire_list(blob) for step, blob in groups if blob is not None}
        return _columns(list(_buckets_from(rows).values()), 1, lr_groups)

    width = bucket_width_for(low, high, max_points // 2)
    plan = plan_reads(low, high, width, None, STEP_LEVELS)
    pieces: list[Piece] = [(None, low, high)]
    if plan is not None:
        # Whole buckets of the coarsest level no wider than the answer's from its rollups,
        # finer levels and then raw rows towards the ends (`plan_reads`).
        width, pieces = plan
    buckets: dict[int, _Bucket] = {}
    for level, first, last in pieces:
        if level is None:
            raw_bucket = Step.step // width
            query = (
                select(raw_bucket, *step_aggregates())
                .where(Step.run_id == run_id, Step.rank == rank, Step.step.between(first, last))
                .group_by(raw_bucket)
            )
        else:
            query = _rollup_query(run_id, rank, level, first, last, width)
        _merge(buckets, session.execute(query))
    return _columns([buckets[key] for key in sorted(buckets)], width)


def _rollup_query(run_id: int, rank: int, level: int, first: int, last: int, width: int) -> Any:
    """The `level`-step rollups starting in first..last, combined per `width`-step bucket."""
    source, of_level = level_source(level)
    key = source.bucket_start // width
    return (
        select(key, *rollup_aggregates(source))
        .where(
            *of_level,
            source.run_id == run_id,
            source.rank == rank,
            source.bucket_start.between(first, last),
        )
        .group_by(key)
    )


def _buckets_from(rows: Any) -> dict[int, _Bucket]:
    buckets: dict[int, _Bucket] = {}
    _merge(buckets, rows)
    return buckets


def _wire_list(blob: bytes) -> list[WireFloat]:
    """A packed little-endian float64 array (`steps.lr_groups`) in the wire encoding."""
    return encode_floats(np.frombuffer(blob, dtype="<f8").tolist())


def _columns(
    buckets: list[_Bucket], width: int, lr_groups: dict[int, list[WireFloat]] | None = None
) -> StepSeries:
    """The buckets as columns. `lr_groups` by step, for an answer that is not downsampled:
    a bucket's min and max of each group would not be one step's groups, so a downsampled
    answer carries null there (zoom in, or raise max_points, to read them)."""
    lr_groups = lr_groups or {}
    steps: list[int] = []
    skipped: list[bool] = []
    skipped_count: list[int] = []
    floats: dict[str, list[WireFloat | None]] = {name: [] for name in STEP_FLOAT_FIELDS}
    thresholds: list[WireFloat | None] = []
    above: list[int] = []
    for bucket in buckets:
        points = (
            [(bucket.first, 0)]
            if bucket.first == bucket.last
            else [
                (bucket.first, 0),
                (bucket.last, 1),
            ]
        )
        for step, extreme in points:
            steps.append(step)
            count = bucket.skipped if extreme == 0 else 0
            skipped.append(count > 0)
            skipped_count.append(count)
            above.append(bucket.above if extreme == 0 else 0)
            thresholds.append(encode_float(bucket.drawn_threshold))
            for i, name in enumerate(STEP_FLOAT_FIELDS):
                floats[name].append(encode_float(bucket.extremes[2 * i + extreme]))
    columns: dict[str, Any] = {
        "step": steps, "skipped": skipped, "skipped_count": skipped_count, "bucket_width": width,
        "lr_groups": [lr_groups.get(step) for step in steps], "act_threshold": thresholds,
        "act_above_count": above, **floats,
    }  # fmt: skip
    return StepSeries.model_construct(**columns)
