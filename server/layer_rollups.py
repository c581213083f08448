"""Layer rollups: per-layer maxima and minima of each layer statistic over aligned buckets
of `LAYER_LEVELS` steps, so that whole-run reads of a long run cost the same at any length.

A 2M-step run sampled every 10 steps has 200,000 packed rows per statistic; the heatmap
and one layer's series read them all from `layer_stats` (7 s and 2 s extrapolated at
1,000 tensors). Here each (run, rank, statistic) also has, per level, one row per bucket
of that level's width holding two packed rows like `layer_stats.values` (`maxima` and
`minima`, by layer idx, `MISSING` where no sample of the bucket measured the layer). A
read picks the coarsest level no wider than the buckets it answers in, so it reads
between one and `LEVEL_FACTOR` rows per answered bucket whatever the run's length.

Widths grow by `LEVEL_FACTOR` = 4 from 64 steps: a factor of 2 would halve the rows a read
scans but double the levels ingest refreshes; 8 or 16 would scan up to 16 rows per bucket.
The finest level, 64 steps, is where aged runs keep their history
(`age_layer_stats`). All levels together hold about 1/24 of a row per step against the
raw 1/10 (sampled every 10 steps): the rollups add ~40% to the layer tables.

Extremes follow the series convention (`ampwatch.server.series`): a maximum is NaN when
any sample was NaN, a minimum ignores NaN unless only NaN was measured, and MISSING means
nothing measured; both compose, so a level is computed from the level below it. Ingest
recomputes every touched bucket from the raw rows (level 64) and from the level below
(the others) in the batch's transaction, never merging incrementally, so a re-sent sample
cannot leave a stale extreme behind -- except below an aged run's horizon, where no raw
rows remain and a late sample is merged into the stored extremes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt
from sqlalchemy import bindparam, delete, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server import run_version
from ampwatch.server.db import begin_write
from ampwatch.server.layer_models import LayerRollup, LayerStat
from ampwatch.server.models import Run
from ampwatch.server.packed import MISSING_BITS, unpack_matrix

#: Bucket widths in steps, finest first; each divides the next.
LEVEL_FACTOR = 4
LAYER_LEVELS: tuple[int, ...] = tuple(64 * LEVEL_FACTOR**k for k in range(6))
FINEST = LAYER_LEVELS[0]

#: `layer_rollups` columns in the order of `refresh_layer_rollups`' tuples.
ROLLUP_COLUMNS = (
    "run_id", "rank", "stat", "level", "bucket_start",
    "first_step", "last_step", "samples", "maxima", "minima",
)  # fmt: skip
ROLLUP_KEY = ROLLUP_COLUMNS[:5]

Floats = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]


@dataclass
class Extremes:
    """A bucket's (or a sample's) extremes per layer, with their MISSING masks."""

    first_step: int
    last_step: int
    samples: int
    maxima: Floats
    max_missing: Mask
    minima: Floats
    min_missing: Mask


def max_of(values: Floats, missing: Mask, axis: int = 0) -> tuple[Floats, Mask]:
    """Maxima along `axis`: NaN when any value is NaN, missing values ignored."""
    none = np.all(missing, axis=axis)
    maxima = np.max(np.where(missing, -np.inf, values), axis=axis)
    return np.where(none, np.nan, maxima), none


def min_of(values: Floats, missing: Mask, axis: int = 0) -> tuple[Floats, Mask]:
    """Minima along `axis`: NaN only where nothing but NaN was measured."""
    nan = np.isnan(values) & ~missing
    ordinary = ~(missing | nan)
    has_ordinary = np.any(ordinary, axis=axis)
    minima = np.min(np.where(ordinary, values, np.inf), axis=axis)
    none = ~(has_ordinary | np.any(nan, axis=axis))
    return np.where(has_ordinary, minima, np.nan), none


def pack(values: Floats, missing: Mask) -> bytes:
    """One packed row (`ampwatch.server.packed`): little-endian float64, MISSING marked."""
    bits = values.astype("<f8").view("<u8").copy()
    bits[missing] = MISSING_BITS
    return bytes(bits.tobytes())


def combine(parts: Sequence[Extremes]) -> Extremes:
    """The extremes of the union of `parts` (samples or buckets)."""
    maxima, max_missing = max_of(
        np.stack([p.maxima for p in parts]), np.stack([p.max_missing for p in parts])
    )
    minima, min_missing = min_of(
        np.stack([p.minima for p in parts]), np.stack([p.min_missing for p in parts])
    )
    return Extremes(
        first_step=min(p.first_step for p in parts),
        last_step=max(p.last_step for p in parts),
        samples=sum(p.samples for p in parts),
        maxima=maxima,
        max_missing=max_missing,
        minima=minima,
        min_missing=min_missing,
    )


def _samples(steps: Sequence[int], blobs: Sequence[bytes]) -> list[Extremes]:
    width = max((len(b) // 8 for b in blobs), default=0)
    values, missing = unpack_matrix(list(blobs), width)
    return [
        Extremes(step, step, 1, values[i], missing[i], values[i], missing[i])
        for i, step in enumerate(steps)
    ]


def _stored(rows: Iterable[Any]) -> dict[tuple[str, int], Extremes]:
    """(stat, bucket_start) -> extremes of `layer_rollups` rows read with `_ROLLUP_READ`."""
    out: dict[tuple[str, int], Extremes] = {}
    for stat, bucket, first, last, samples, maxima, minima in rows:
        width = max(len(maxima), len(minima)) // 8
        (max_v, min_v), (max_m, min_m) = unpack_matrix([maxima, minima], width)
        out[(stat, bucket)] = Extremes(first, last, samples, max_v, max_m, min_v, min_m)
    return out


def _widened(parts: list[Extremes]) -> list[Extremes]:
    """Parts padded with MISSING to the widest (rows written before later layers appeared)."""
    width = max(p.maxima.size for p in parts)
    out = []
    for p in parts:
        pad = width - p.maxima.size
        if pad:
            nan, yes = np.full(pad, np.nan), np.ones(pad, dtype=bool)
            p = Extremes(
                p.first_step, p.last_step, p.samples,
                np.concatenate((p.maxima, nan)), np.concatenate((p.max_missing, yes)),
                np.concatenate((p.minima, nan)), np.concatenate((p.min_missing, yes)),
            )  # fmt: skip
        out.append(p)
    return out


def _reduce(parts: list[tuple[str, int, Extremes]], level: int) -> dict[tuple[str, int], Extremes]:
    """(stat, step or bucket start, extremes) parts, reduced per statistic and `level`
    bucket in a few array operations over all of them (one `combine` per bucket, then one
    reduction per statistic, were most of ingest's time spent on rollups)."""
    parts.sort(key=lambda part: (part[0], part[1]))
    keys = np.array([key // level for _, key, _ in parts], dtype=np.int64)
    stat_changes = np.array([a[0] != b[0] for a, b in pairwise(parts)], dtype=bool)
    boundaries = (np.diff(keys) != 0) | stat_changes
    starts = np.concatenate(([0], np.flatnonzero(boundaries) + 1)).astype(np.intp)
    rows = _widened([e for _, _, e in parts])
    max_v, max_m = np.stack([r.maxima for r in rows]), np.stack([r.max_missing for r in rows])
    min_v, min_m = np.stack([r.minima for r in rows]), np.stack([r.min_missing for r in rows])
    max_none = np.logical_and.reduceat(max_m, starts, axis=0)
    maxima = np.maximum.reduceat(np.where(max_m, -np.inf, max_v), starts, axis=0)
    maxima[max_none] = np.nan
    nan = np.isnan(min_v) & ~min_m
    ordinary = ~(min_m | nan)
    has_ordinary = np.logical_or.reduceat(ordinary, starts, axis=0)
    minima = np.minimum.reduceat(np.where(ordinary, min_v, np.inf), starts, axis=0)
    minima = np.where(has_ordinary, minima, np.nan)
    min_none = ~(has_ordinary | np.logical_or.reduceat(nan, starts, axis=0))
    firsts = np.minimum.reduceat(np.array([r.first_step for r in rows]), starts)
    lasts = np.maximum.reduceat(np.array([r.last_step for r in rows]), starts)
    counts = np.add.reduceat(np.array([r.samples for r in rows]), starts)
    return {
        (parts[start][0], int(keys[start]) * level): Extremes(
            int(firsts[i]),
            int(lasts[i]),
            int(counts[i]),
            maxima[i],
            max_none[i],
            minima[i],
            min_none[i],
        )
        for i, start in enumerate(starts)
    }


def build_levels(
    samples: Iterable[tuple[str, int, Extremes]],
    children: dict[int, dict[tuple[str, int], Extremes]],
) -> dict[int, dict[tuple[str, int], Extremes]]:
    """Every level's buckets from the (stat, step, extremes) samples of the finest level's
    touched buckets and, per coarser level, the stored children of its touched buckets
    (`children[level]`: (stat, bucket_start) of the level below -> extremes; the ones
    recomputed here replace them)."""
    levels: dict[int, dict[tuple[str, int], Extremes]] = {}
    below = list(samples)
    for level in LAYER_LEVELS:
        if level > FINEST:
            merged = {**children.get(level, {}), **levels[level // LEVEL_FACTOR]}
            below = [(stat, start, e) for (stat, start), e in merged.items()]
        levels[level] = _reduce(below, level) if below else {}
    return levels


def _row(run_id: int, rank: int, stat: str, level: int, start: int, e: Extremes) -> tuple[Any, ...]:
    return (
        run_id, rank, stat, level, start, e.first_step, e.last_step, e.samples,
        pack(e.maxima, e.max_missing), pack(e.minima, e.min_missing),
    )  # fmt: skip


#: The reads of `refresh_layer_rollups`, built once with named parameters (`run_id`,
#: `rank`, `stats`, `level`, `low`, `high`): building six selects per batch cost more
#: than running them.
_ROLLUP_READ = select(
    LayerRollup.stat,
    LayerRollup.bucket_start,
    LayerRollup.first_step,
    LayerRollup.last_step,
    LayerRollup.samples,
    LayerRollup.maxima,
    LayerRollup.minima,
).where(
    LayerRollup.run_id == bindparam("run_id"),
    LayerRollup.rank == bindparam("rank"),
    LayerRollup.stat.in_(bindparam("stats", expanding=True)),
    LayerRollup.level == bindparam("level"),
    LayerRollup.bucket_start.between(bindparam("low"), bindparam("high")),
)
_RAW_READ = select(LayerStat.stat, LayerStat.step, LayerStat.values).where(
    LayerStat.run_id == bindparam("run_id"),
    LayerStat.rank == bindparam("rank"),
    LayerStat.stat.in_(bindparam("stats", expanding=True)),
    LayerStat.step.between(bindparam("low"), bindparam("high")),
)


def _read_level(
    session: Session, run_id: int, rank: int, stats: list[str], level: int, low: int, high: int
) -> dict[tuple[str, int], Extremes]:
    where = {"run_id": run_id, "rank": rank, "stats": stats, "level": level}
    return _stored(session.connection().execute(_ROLLUP_READ, {**where, "low": low, "high": high}))


def refresh_layer_rollups(
    session: Session,
    run_id: int,
    spans: dict[int, tuple[int, int, set[str]]],
    aged_before: int | None = None,
) -> list[tuple[Any, ...]]:
    """The `layer_rollups` rows (tuples in `ROLLUP_COLUMNS` order) covering steps
    `first..last` of the statistics `stats`, per rank -> (first, last, stats), recomputed
    from the raw rows the transaction holds; the caller upserts them.

    Below `aged_before` (an aged run's horizon) the stored finest buckets are merged in:
    their raw rows are gone.
    """
    out: list[tuple[Any, ...]] = []
    for rank, (first, last, stat_set) in spans.items():
        stats = sorted(stat_set)
        low, high = first // FINEST * FINEST, last // FINEST * FINEST + FINEST - 1
        where = {"run_id": run_id, "rank": rank, "stats": stats, "low": low, "high": high}
        raw = session.connection().execute(_RAW_READ, where).all()
        samples = [
            (stat, step, sample)
            for (stat, step, _), sample in zip(
                raw, _samples([r[1] for r in raw], [r[2] for r in raw])
            )
        ]
        if aged_before is not None and low < aged_before:
            kept = _read_level(session, run_id, rank, stats, FINEST, low, aged_before - 1)
            samples += [(stat, start, e) for (stat, start), e in kept.items()]
        children = {
            level: _read_level(
                session, run_id, rank, stats, below,
                first // level * level, last // level * level + level - 1,
            )
            for below, level in pairwise(LAYER_LEVELS)
        }  # fmt: skip
        for level, buckets in build_levels(samples, children).items():
            out += [
                _row(run_id, rank, stat, level, start, e) for (stat, start), e in buckets.items()
            ]
    return out


def rollups_from_rows(
    run_id: int, rank: int, stat: str, rows: Iterable[tuple[int, bytes]]
) -> list[tuple[Any, ...]]:
    """Every level's rows of one (run, rank, statistic) from its raw (step, values) rows,
    a finest bucket at a time (`bench/query.py`'s bulk build; migration 0011 holds a frozen
    copy of the reduction as of its revision)."""
    finest: list[tuple[str, int, Extremes]] = []
    bucket: list[tuple[int, bytes]] = []

    def flush() -> None:
        if bucket:
            steps, blobs = zip(*bucket)
            finest.append((stat, steps[0], combine(_widened(_samples(steps, blobs)))))
            bucket.clear()

    for step, blob in rows:
        if bucket and step // FINEST != bucket[0][0] // FINEST:
            flush()
        bucket.append((step, bytes(blob)))
    flush()
    return [
        _row(run_id, rank, s, level, start, e)
        for level, buckets in build_levels(finest, {}).items()
        for (s, start), e in buckets.items()
    ]


#: A read piece: (level, first, last) reads the rollups of `level` whose buckets start in
#: first..last; (None, first, last) the raw rows of steps first..last.
Piece = tuple[int | None, int, int]


def plan_reads(
    low: int, high: int, width: int, aged_before: int | None, levels: tuple[int, ...] = LAYER_LEVELS
) -> tuple[int, list[Piece]] | None:
    """How to read steps low..high in buckets of at least `width` steps: the bucket width
    (a multiple of the coarsest level used, so each rollup lies in one bucket) and the
    pieces -- whole buckets of the coarsest level no wider than `width`, then finer levels
    towards the ends, raw rows for the steps under the finest level left at each end.
    None: read the raw rows (`width` under the finest level and nothing aged in the
    window). `levels`: the layer rollups' by default; the step series reads by this plan
    too, over the step rollups' (`rollups.STEP_LEVELS`, one finer).

    >>> plan_reads(10, 5000, 300, None)
    (512, [(None, 10, 63), (64, 64, 192), (256, 256, 4608), (64, 4864, 4928), (None, 4992, 5000)])
    """
    aged = aged_before is not None and low < aged_before
    if width < levels[0] and not aged:
        return None
    top = max(k for k, level in enumerate(levels) if level <= max(width, levels[0]))
    pieces: list[Piece] = []

    def cover(first: int, last: int, k: int) -> None:
        if first > last:
            return
        if k < 0:
            if aged_before is not None and first < aged_before:  # no raw rows: the buckets
                aged_last = min(last, aged_before - 1)
                pieces.append((FINEST, first // FINEST * FINEST, aged_last // FINEST * FINEST))
                first = aged_last + 1
            if first <= last:
                pieces.append((None, first, last))
            return
        level = levels[k]
        whole_first = -(-first // level) * level
        whole_last = (last + 1) // level * level - 1
        if whole_first > whole_last:
            cover(first, last, k - 1)
            return
        cover(first, whole_first - 1, k - 1)
        pieces.append((level, whole_first, whole_last - level + 1))
        cover(whole_last + 1, last, k - 1)

    cover(low, high, top)
    level = levels[top]
    return max(level, -(-width // level) * level), pieces


def age_runs(sessions: sessionmaker[Session], keep_steps: int) -> dict[int, int]:
    """Age every run whose raw layer samples span more than `keep_steps` (one transaction
    per run, the run locked as ingest locks it); returns run id -> raw rows deleted."""
    with sessions() as session:
        run_ids = list(session.scalars(select(Run.id).order_by(Run.id)))
    aged = {}
    for run_id in run_ids:
        with sessions() as session:
            begin_write(session)
            run = session.scalars(select(Run).where(Run.id == run_id).with_for_update()).first()
            deleted = 0 if run is None else age_layer_stats(session, run, keep_steps)
            session.commit()
        if deleted:
            aged[run_id] = deleted
    return aged


def age_layer_stats(session: Session, run: Run, keep_steps: int) -> int:
    """Delete the run's raw layer samples more than `keep_steps` before its last one,
    aligned down to the finest level, keeping every rollup; returns the rows deleted.

    Reads of the aged span come from the finest rollups (64-step buckets of maxima and
    minima), so the heatmap, the layer series and zoom stay correct at that resolution.
    """
    last = session.scalar(select(func.max(LayerStat.step)).where(LayerStat.run_id == run.id))
    if last is None:
        return 0
    horizon = max(0, last - keep_steps) // FINEST * FINEST
    if horizon <= (run.layer_stats_aged_before or 0):
        return 0
    deleted = session.execute(
        delete(LayerStat).where(LayerStat.run_id == run.id, LayerStat.step < horizon)
    )
    session.execute(update(Run).where(Run.id == run.id).values(layer_stats_aged_before=horizon))
    run_version.bump_where(session, Run.id == run.id)  # a zoomed window reads the rollups
    return int(deleted.rowcount or 0)  # type: ignore[attr-defined]
