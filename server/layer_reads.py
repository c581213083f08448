"""The layer reads: one statistic's layers x steps matrix, and one layer's series.

Downsampled as `ampwatch.server.series` describes (buckets aligned to multiples of their
width; the matrix keeps bucket maxima, a layer's series the minimum and maximum points),
from the raw `layer_stats` rows of a short range or the layer rollups of a long one
(`ampwatch.server.layer_rollups`), read through the driver (`_fetch_rows`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import ACTIVATION_STATS
from ampwatch.server.layer_models import Layer, Module
from ampwatch.server.layer_rollups import FINEST, Piece, plan_reads
from ampwatch.server.packed import MISSING_BITS, to_wire_rows, unpack_matrix
from ampwatch.server.schemas.runs import LayerMatrix, LayerSeries
from ampwatch.server.schemas.wire import MAX_STEP
from ampwatch.server.segments import reduce_at
from ampwatch.server.series import bucket_width_for


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
