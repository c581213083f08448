"""A batch's layer records stored: the run's layer and module names numbered (the committed
numbering cached per engine), the statistics packed into one row per (rank, statistic,
step) (`ampwatch.server.layer_models`), their rollups refreshed, the exponent histograms.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import datetime
from typing import Any
from weakref import WeakKeyDictionary

import numpy as np
import numpy.typing as npt
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import ACTIVATION_STATS
from ampwatch.server.db import upsert
from ampwatch.server.layer_models import Layer, LayerHistogram, LayerRollup, LayerStat, Module
from ampwatch.server.layer_rollups import ROLLUP_COLUMNS, ROLLUP_KEY, refresh_layer_rollups
from ampwatch.server.models import Run
from ampwatch.server.packed import pack_row
from ampwatch.server.schemas.wire import LayerStatsIn

#: Per engine, the committed name -> idx mappings of recently written runs, by (model,
#: run id, run creation time): reading a 500-layer run's names back cost ~1.2 ms of a
#: ~7 ms batch. Only mappings read from the database are kept, never names this
#: transaction inserts (a rollback would leave them dangling); an assignment never
#: changes once committed, so a hit is always right and a miss rereads the table. The
#: creation time tells a new run from a deleted one whose id SQLite reused. Bounded by
#: runs and by names in all (~150 bytes each): a count of runs alone let a few runs with
#: a million names each hold gigabytes.
_NAMES: WeakKeyDictionary[Engine, OrderedDict[tuple[str, int, datetime], dict[str, int]]]
_NAMES = WeakKeyDictionary()
_NAMES_PER_ENGINE = 1024
_NAMES_CACHED_PER_ENGINE = 200_000
_NAMES_LOCK = threading.Lock()


def _remember(
    cache: OrderedDict[tuple[str, int, datetime], dict[str, int]],
    key: tuple[str, int, datetime],
    indices: dict[str, int],
) -> None:
    """Cache `indices`, then evict the least recently used runs down to both bounds."""
    cache[key] = indices
    cache.move_to_end(key)
    cached = sum(map(len, cache.values()))
    while cache and (len(cache) > _NAMES_PER_ENGINE or cached > _NAMES_CACHED_PER_ENGINE):
        cached -= len(cache.popitem(last=False)[1])


def _name_indices(
    session: Session, model: type[Layer | Module], run: Run, names: list[list[str]]
) -> dict[str, int]:
    """The run's name -> idx in `model`'s table, numbering (and inserting) new names.
    Read it only: without new names it is the cache's own mapping."""
    key = (model.__tablename__, run.id, run.created_at)
    # Set operations: a name at a time in Python was ~1 ms of a 20-record, 500-layer batch.
    wanted = set().union(*names)
    with _NAMES_LOCK:  # request threads share the cache
        cache = _NAMES.setdefault(session.get_bind().engine, OrderedDict())
        indices = cache.get(key)
    if indices is None or not indices.keys() >= wanted:
        rows = session.execute(select(model.name, model.idx).where(model.run_id == run.id))
        indices = {str(name): int(idx) for name, idx in rows}
        with _NAMES_LOCK:
            _remember(cache, key, indices)
    else:
        with _NAMES_LOCK:
            if key in cache:
                cache.move_to_end(key)
    new: list[tuple[int, int, str]] = []
    if not indices.keys() >= wanted:
        indices = dict(indices)
        for record_names in names:
            for name in record_names:
                if name not in indices:
                    indices[name] = len(indices)
                    new.append((run.id, indices[name], name))
    # One bulk statement of plain tuples (the wire's `Name` refused NUL already): the ORM's
    # per-row insert took 8 of the 13 s a batch of 65,536 new names held the write lock.
    upsert(session, model, ("run_id", "idx", "name"), new, ("run_id", "idx"))
    return indices


_PackedParts = dict[
    tuple[int, str, int], list[tuple[npt.NDArray[np.intp], npt.NDArray[np.float64]]]
]


#: `layer_stats` columns in the order of `_packed_rows`' tuples.
LAYER_STAT_COLUMNS = ("run_id", "rank", "stat", "step", "values")
LAYER_STAT_KEY = ("run_id", "rank", "stat", "step")


def _packed_rows(run_id: int, parts: _PackedParts, width: int) -> list[tuple[Any, ...]]:
    return [
        (run_id, rank, stat, step, pack_row(width, key_parts))
        for (rank, stat, step), key_parts in parts.items()
    ]


def store_layer_stats(session: Session, run: Run, records: list[LayerStatsIn]) -> None:
    """Parameter statistics packed by `layers.idx`; activation statistics by `modules.idx`."""
    if not records:
        return
    run_id = run.id
    layer_idx = _name_indices(session, Layer, run, [r.names for r in records])
    parts: _PackedParts = {}
    indices = np.empty(0, np.intp)
    names: list[str] = []
    for record in records:
        if record.names != names:  # a batch's records name the same layers, as a rule
            names = record.names
            indices = np.fromiter((layer_idx[n] for n in names), np.intp, len(names))
        for stat, values in record.stats.items():
            # The wire strings "NaN"/"Infinity"/"-Infinity" are what float() parses.
            array = np.asarray(values, dtype=np.float64)
            parts.setdefault((record.rank, stat, record.step), []).append((indices, array))
    rows = _packed_rows(run_id, parts, len(layer_idx))

    measured = [r for r in records if r.activations is not None]
    if measured:
        activations = [r.activations for r in measured if r.activations is not None]
        module_idx = _name_indices(session, Module, run, [a.names for a in activations])
        module_parts: _PackedParts = {}
        for record, act in zip(measured, activations):
            indices = np.fromiter((module_idx[n] for n in act.names), np.intp, len(act.names))
            key = (record.rank, ACTIVATION_STATS[0], record.step)
            module_parts.setdefault(key, []).append((indices, act.max_abs))
        rows += _packed_rows(run_id, module_parts, len(module_idx))
    upsert(session, LayerStat, LAYER_STAT_COLUMNS, rows, LAYER_STAT_KEY)
    upsert(
        session, LayerRollup, ROLLUP_COLUMNS,
        refresh_layer_rollups(session, run_id, _spans(rows), run.layer_stats_aged_before),
        ROLLUP_KEY,
    )  # fmt: skip
    _store_histograms(session, run_id, records, layer_idx)


def _spans(rows: list[tuple[Any, ...]]) -> dict[int, tuple[int, int, set[str]]]:
    """Per rank, the first and last step and the statistics of the stored packed rows."""
    spans: dict[int, tuple[int, int, set[str]]] = {}
    for _, rank, stat, step, _ in rows:
        first, last, stats = spans.get(rank, (step, step, set()))
        stats.add(stat)
        spans[rank] = (min(first, step), max(last, step), stats)
    return spans


#: `layer_histograms` columns in the order of `_store_histograms`' tuples.
_HISTOGRAM_COLUMNS = ("run_id", "rank", "layer_idx", "step", "first_bin", "counts")


def _store_histograms(
    session: Session, run_id: int, records: list[LayerStatsIn], layer_idx: dict[str, int]
) -> None:
    latest: dict[tuple[int, int, int], tuple[Any, ...]] = {}
    for record in records:
        histograms = record.exponent_histograms
        if histograms is None:
            continue
        for name, first_bin, counts in zip(record.names, histograms.offsets, histograms.counts):
            key = (record.rank, layer_idx[name], record.step)
            packed = counts.astype("<i8", copy=False).tobytes()
            latest[key] = (run_id, *key, first_bin, packed)
    upsert(
        session, LayerHistogram, _HISTOGRAM_COLUMNS, list(latest.values()), _HISTOGRAM_COLUMNS[:4]
    )
