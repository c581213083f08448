"""Downsampled reads of long runs: step series, the layers x steps matrix, one layer.

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
import numpy.typing as npt
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import (
    ACTIVATION_STATS,
    STEP_FLOAT_FIELDS,
    WireFloat,
    encode_float,
    encode_floats,
)
from ampwatch.server.layer_models import Layer, Module
from ampwatch.server.layer_rollups import FINEST, Piece, plan_reads
from ampwatch.server.packed import MISSING_BITS, to_wire_rows, unpack_matrix
from ampwatch.server.rollups import STEP_LEVELS, level_source, rollup_aggregates, step_aggregates
from ampwatch.server.schemas.runs import LayerMatrix, LayerSeries, StepSeries
from ampwatch.server.schemas.wire import MAX_STEP
from ampwatch.server.segments import reduce_at
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


def _names_table(stat: str) -> type[Layer | Module]:
    """Activation statistics are packed by the run's module list, the others by its layers."""
    table: type[Layer | Module] = Module if stat in ACTIVATION_STATS else Layer
    return table


def _layer_names(session: Session, run_id: int, stat: str) -> list[str]:
    table = _names_table(stat)
    return list(
        session.scalars(select(table.name).where(table.run_id == run_id).order_by(table.idx))
    )


def _fetch_rows(session: Session, sql: str, params: tuple[Any, ...]) -> list[Any]:
    """Rows of driver-level `sql` (`{0}` marks a parameter) in the session's transaction.

    Driver-level because at 10,000 rows SQLAlchemy's row processing was a third of the
    time. On PostgreSQL through a binary cursor: in the text protocol a bytea travels as
    hex, twice its size, and decoding it was most of the heatmap (10,000 packed rows of
    500 layers: 246 ms as text, 130 ms binary).
    """
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        driver = connection.connection.driver_connection
        with driver.cursor(binary=True) as cursor:  # type: ignore[union-attr]
            cursor.execute(sql.format("%s"), params)
            return list(cursor.fetchall())
    mark = "?" if connection.dialect.paramstyle == "qmark" else "%s"
    return list(connection.exec_driver_sql(sql.format(mark), params).fetchall())


def _step_starts(steps: npt.NDArray[np.int64], width: int) -> npt.NDArray[np.intp]:
    """Index of the first row of each `width`-step bucket in sorted `steps`."""
    keys = steps // width
    return np.concatenate(([0], np.flatnonzero(np.diff(keys)) + 1)).astype(np.intp)


def _max_reduce(
    values: npt.NDArray[np.float64],
    missing: npt.NDArray[np.bool_],
    starts: npt.NDArray[np.intp],
    axis: int,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """Bucket maxima along `axis` (NaN wins, missing ignored) and all-missing masks."""
    if not missing.any():  # the usual case: the masking was half a 2M-step heatmap's time
        maxima = reduce_at(np.maximum, values, starts, axis)
        return maxima, np.zeros(maxima.shape, dtype=bool)
    maxima = reduce_at(np.maximum, np.where(missing, -np.inf, values), starts, axis)
    all_missing = reduce_at(np.logical_and, missing, starts, axis)
    return np.where(all_missing, np.nan, maxima), all_missing


def _min_reduce(
    values: npt.NDArray[np.float64], missing: npt.NDArray[np.bool_], starts: npt.NDArray[np.intp]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """Bucket minima (NaN only where nothing else was measured) and all-missing masks."""
    nan = np.isnan(values) & ~missing
    ordinary = ~(missing | nan)
    mins = reduce_at(np.minimum, np.where(ordinary, values, np.inf), starts)
    has_ordinary = reduce_at(np.logical_or, ordinary, starts)
    has_nan = reduce_at(np.logical_or, nan, starts)
    return np.where(has_ordinary, mins, np.nan), ~(has_ordinary | has_nan)


#: Driver-level reads of the rollups of one level (`{0}`: parameters; the heatmap's
#: maxima rows, or one layer's minimum and maximum cells).
_ROLLUP_ROWS = (
    "SELECT first_step, last_step, {cells} FROM layer_rollups WHERE run_id = {{0}} "
    "AND rank = {{0}} AND stat = {{0}} AND level = {{0}} AND bucket_start >= {{0}} "
    "AND bucket_start <= {{0}} ORDER BY bucket_start"
)


def _layer_bounds(
    session: Session, run_id: int, rank: int, stat: str, start: int | None, end: int | None
) -> tuple[int, int, int | None] | None:
    """The first and last sampled step of `stat` within [start, end] as the finest rollups
    know them (to the bucket), and the run's aged horizon; None when nothing is stored."""
    start, end = start or 0, MAX_STEP if end is None else end
    key = "run_id = {0} AND rank = {0} AND stat = {0} AND level = {0}"
    rows = _fetch_rows(
        session,
        f"SELECT (SELECT first_step FROM layer_rollups WHERE {key} AND bucket_start >= {{0}} "
        "ORDER BY bucket_start LIMIT 1), "
        f"(SELECT last_step FROM layer_rollups WHERE {key} AND bucket_start <= {{0}} "
        "ORDER BY bucket_start DESC LIMIT 1), "
        "(SELECT layer_stats_aged_before FROM runs WHERE id = {0})",
        (run_id, rank, stat, FINEST, start // FINEST * FINEST,
         run_id, rank, stat, FINEST, end, run_id),
    )  # fmt: skip
    first, last, aged = rows[0]
    if first is None or last is None:
        return None
    low, high = max(int(first), start), min(int(last), end)
    return (low, high, aged) if low <= high else None


def _read_plan(
    session: Session,
    run_id: int,
    rank: int,
    stat: str,
    *,
    start: int | None,
    end: int | None,
    buckets: int,
) -> tuple[int, list[Piece]] | None:
    """The rollup read for `buckets` buckets over [start, end], or None for the raw rows."""
    bounds = _layer_bounds(session, run_id, rank, stat, start, end)
    if bounds is None:
        return None
    low, high, aged = bounds
    plan: tuple[int, list[Piece]] | None = plan_reads(
        low, high, bucket_width_for(low, high, buckets), None if aged is None else int(aged)
    )
    return plan


def _planned_rows(
    session: Session, run_id: int, rank: int, stat: str, pieces: list[Piece], cells: str
) -> list[Any]:
    """(first step, last step, *cells) of every piece, in step order: raw rows as one-step
    buckets, rollups as theirs; `{max}` and `{min}` in `cells` name the packed column."""
    rows: list[Any] = []
    for level, first, last in pieces:
        if level is None:
            sql = _LAYER_ROWS.format(cells=cells.format(max='"values"', min='"values"'))
            rows += [
                (step, step, *rest)
                for step, *rest in _fetch_rows(session, sql, (run_id, rank, stat, first, last))
            ]
        else:
            sql = _ROLLUP_ROWS.format(cells=cells.format(max="maxima", min="minima"))
            rows += _fetch_rows(session, sql, (run_id, rank, stat, level, first, last))
    return rows


#: Driver-level read of raw rows in a step range.
_LAYER_ROWS = (
    "SELECT step, {cells} FROM layer_stats WHERE run_id = {{0}} AND rank = {{0}} "
    "AND stat = {{0}} AND step >= {{0}} AND step <= {{0}} ORDER BY step"
)


def layer_matrix(
    session: Session,
    run_id: int,
    stat: str,
    rank: int,
    *,
    start: int | None = None,
    end: int | None = None,
    max_steps: int,
    max_layers: int,
) -> LayerMatrix:
    """One statistic for every layer (every leaf module for an activation statistic): rows
    by step, columns by layer, each axis reduced to
    bucket maxima when longer than its limit (every statistic here is "worse when higher":
    a frozen layer's zero fraction of 1.0 stays 1.0 in its bucket). A long range is read
    from the layer rollups (`ampwatch.server.layer_rollups`): ~2,000 rows at any length."""
    names = _layer_names(session, run_id, stat)
    plan = _read_plan(session, run_id, rank, stat, start=start, end=end, buckets=max_steps)
    if plan is None:
        rows = [
            (step, step, blob)
            for step, blob in _fetch_rows(
                session,
                _LAYER_ROWS.format(cells='"values"'),
                (run_id, rank, stat, start or 0, MAX_STEP if end is None else end),
            )
        ]
    else:
        rows = _planned_rows(session, run_id, rank, stat, plan[1], "{max}")
    steps = np.fromiter((first for first, _, _ in rows), np.int64, len(rows))
    values, missing = unpack_matrix([blob for _, _, blob in rows], len(names))
    step_width = layer_width = 1
    if plan is not None or len(rows) > max_steps:
        step_width = (
            plan[0]
            if plan is not None
            else bucket_width_for(int(steps[0]), int(steps[-1]), max_steps)
        )
        if len(steps):
            starts = _step_starts(steps, step_width)
            values, missing = _max_reduce(values, missing, starts, axis=0)
            steps = steps[starts]
    if len(names) > max_layers:
        layer_width = -(-len(names) // max_layers)
        starts = np.arange(0, len(names), layer_width, dtype=np.intp)
        values, missing = _max_reduce(values, missing, starts, axis=1)
        names = [names[i] for i in starts]
    return LayerMatrix.model_construct(
        stat=stat,
        layers=names,
        steps=steps.tolist(),
        values=to_wire_rows(values, missing),
        step_width=step_width,
        layer_width=layer_width,
    )


def layer_index(session: Session, run_id: int, name: str, stat: str) -> int | None:
    """The layer's (or, for an activation statistic, the module's) column in the run's
    packed rows of `stat`, or None when the run has no such layer."""
    table = _names_table(stat)
    return session.scalar(select(table.idx).where(table.run_id == run_id, table.name == name))


def layer_series(
    session: Session,
    run_id: int,
    layer: str,
    idx: int,
    stat: str,
    rank: int,
    *,
    start: int | None = None,
    end: int | None = None,
    max_points: int,
) -> LayerSeries:
    """One layer's statistic over steps, min/max-downsampled like `step_series`; a long
    range from the layer rollups, so its cost grows with neither the run nor its layers.

    Reads 8 bytes of each packed row (SQL substr), not the row: the cost of one layer does
    not grow with the number of layers.
    """
    plan = _read_plan(session, run_id, rank, stat, start=start, end=end, buckets=max_points // 2)
    offset = idx * 8 + 1
    cell = f"substr({{min}}, {offset}, 8), substr({{max}}, {offset}, 8)"
    if plan is None:
        rows = [
            (step, step, value, value)
            for step, value in _fetch_rows(
                session,
                _LAYER_ROWS.format(cells=f'substr("values", {offset}, 8)'),
                (run_id, rank, stat, start or 0, MAX_STEP if end is None else end),
            )
        ]
    else:
        rows = _planned_rows(session, run_id, rank, stat, plan[1], cell)
    firsts = np.fromiter((row[0] for row in rows), np.int64, len(rows))
    lasts = np.fromiter((row[1] for row in rows), np.int64, len(rows))
    mins, min_missing = _cells([row[2] for row in rows])
    maxs, max_missing = _cells([row[3] for row in rows])
    width = 1
    if plan is not None or len(rows) > max_points:
        width = (
            plan[0]
            if plan is not None
            else bucket_width_for(int(firsts[0]), int(firsts[-1]), max_points // 2)
        )
        steps, values, missing = _min_max_points(
            firsts, lasts, (mins, min_missing), (maxs, max_missing), width
        )
    else:
        steps, values, missing = firsts, maxs, max_missing
    (column,) = to_wire_rows(values[None, :], missing[None, :]) if len(values) else ([],)
    return LayerSeries.model_construct(
        layer=layer, stat=stat, rank=rank, step=steps.tolist(), value=column, bucket_width=width
    )


def _cells(cells: list[Any]) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """8-byte cells (None, or short, where a row predates the layer) as values and mask."""
    missing_cell = MISSING_BITS.tobytes()
    packed = b"".join(
        bytes(cell) if cell is not None and len(cell) == 8 else missing_cell for cell in cells
    )
    bits = np.frombuffer(packed, dtype="<u8")
    return bits.view("<f8").astype(np.float64), bits == MISSING_BITS


Cells = tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]


def _min_max_points(
    firsts: npt.NDArray[np.int64],
    lasts: npt.NDArray[np.int64],
    minima: Cells,
    maxima: Cells,
    width: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """Two points per bucket -- (first step, min), (last step, max) -- as for step series,
    from one-step samples and rollup buckets alike (sorted by first step)."""
    if not len(firsts):
        return firsts, minima[0], minima[1]
    starts = _step_starts(firsts, width)
    mins, min_missing = _min_reduce(*minima, starts)
    maxs, max_missing = _max_reduce(*maxima, starts, axis=0)
    out_first, out_last = firsts[starts], np.maximum.reduceat(lasts, starts)
    single = out_first == out_last
    # Interleave (min, max) per bucket, then drop the max of one-step buckets.
    out_steps = np.column_stack((out_first, out_last)).ravel()
    out_values = np.column_stack((mins, maxs)).ravel()
    out_missing = np.column_stack((min_missing, max_missing)).ravel()
    keep = np.column_stack((np.ones_like(single), ~single)).ravel()
    return out_steps[keep], out_values[keep], out_missing[keep]
