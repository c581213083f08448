"""Store one validated wire batch: all of it in one transaction, or none of it.

Idempotency: every stored batch leaves its (run, stream, seq) in `ingested_batches`; a
batch seen before is acknowledged as a duplicate and changes nothing, so an agent may retry
freely. The stream (one per agent process) keeps the ranks of a run, and a run resumed
under the same id, from claiming each other's sequence numbers.
Within and across batches a re-sent step (or layer-stats row) overwrites the earlier one,
except across a `resumed` event: the steps after its checkpoint are moved aside first
(`ampwatch.server.rollback`), so the abandoned tail is kept and the new branch stored anew.

Sequence numbers need not arrive in order: any (run, stream, seq) not stored yet is applied. The
agent replays its spool in order, but a retry of batch n can land after batch n+1 went
through on another connection; refusing it would lose data the agent then drops, and
since a later write of a step wins, only a re-sent *older* value of the same step could
be affected -- which the agent never produces (a step is measured once).

Sharded grad norms (`_combine_grad_norms`): under FSDP2 / FSDP1 without a clip, every rank
sends its part of a step's squared global grad norm (`grad_sumsq`, `grad_parts` = the world
size); the ranks' batches arrive in any order and any grouping. Each part is stored
(`grad_norm_parts`), and the batch that brings a step's last missing part writes
`grad_norm` = sqrt(sum of all parts) on the step's rank-0 row: into the batch's own rank-0
record when it carries that step (before the rule engine reads it), else as an update of
the stored row (its rollups refreshed). The sum is `math.fsum`, exactly rounded, so the norm
is the same bit for bit whatever the order, and recomputing it on a re-sent part is
idempotent; a step whose parts never all arrive keeps a NULL norm. The rule engine reads
a rank-0 record when its batch is stored (`alerts.evaluate`); a norm completed by a later
batch of another rank is handed to it with that batch (`late_norms`), so `grad_norm_spike`
judges it either way.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from datetime import datetime, timezone
from operator import attrgetter
from typing import Any
from weakref import WeakKeyDictionary

import numpy as np
import numpy.typing as npt
from sqlalchemy import Engine, Table, bindparam, func, select, update
from sqlalchemy.orm import Session

from ampwatch.agent.wire import (
    ACTIVATION_STATS,
    DROPPED_KINDS,
    MAX_NAME_LENGTH,
    STEP_FLOAT_FIELDS,
    decode_float,
    encode_float,
)
from ampwatch.server import run_version
from ampwatch.server.alerts import evaluate_batch
from ampwatch.server.alerts.evaluate import Judged
from ampwatch.server.alerts.spikes import LateNorm
from ampwatch.server.auth import ensure_project
from ampwatch.server.column_types import sqlite_float
from ampwatch.server.db import begin_write, dialect_insert, upsert
from ampwatch.server.firing import firing_alerts
from ampwatch.server.layer_models import Layer, LayerHistogram, LayerRollup, LayerStat, Module
from ampwatch.server.layer_rollups import ROLLUP_COLUMNS, ROLLUP_KEY, refresh_layer_rollups
from ampwatch.server.models import RUN_KEY, Event, IngestedBatch, Run, utcnow
from ampwatch.server.packed import pack_row
from ampwatch.server.rollback import retire_abandoned_steps
from ampwatch.server.rollups import refresh_step_rollups
from ampwatch.server.schemas.runs import IngestAck
from ampwatch.server.schemas.wire import BatchIn, EventIn, LayerStatsIn, StepIn
from ampwatch.server.step_models import GradNormPart, Step


def ingest_batch(
    session: Session, batch: BatchIn, *, now: datetime | None = None, evaluate_alerts: bool = True
) -> IngestAck:
    """Store `batch`, creating its run on first sight; returns the acknowledgement.
    `evaluate_alerts=False` stores without the rule engine: only for populating a bench
    database, whose queries are measured, not its alerts (at 1,000 layers the rules were
    three quarters of the populating time).

    Writers of one run are serialised (SQLite: one writer at a time; PostgreSQL: a row
    lock on the run), so concurrent batches of a run -- several ranks, retries racing the
    original -- cannot both claim a (stream, seq) or the same new layer index.

    >>> ingest_batch(session, BatchIn.model_validate_json(body))  # doctest: +SKIP
    IngestAck(run_id=1, stream='9c1e...', seq=0, duplicate=False)
    """
    now = now or utcnow()
    begin_write(session)
    run = _lock_run(session, batch, now)
    ack = IngestAck(run_id=run.id, stream=batch.stream, seq=batch.seq, duplicate=False)
    if session.get(IngestedBatch, (run.id, batch.stream, batch.seq)) is not None:
        session.rollback()
        return ack.model_copy(update={"duplicate": True, "alerts": firing_alerts(session, run.id)})

    session.add(IngestedBatch(run_id=run.id, stream=batch.stream, seq=batch.seq, received_at=now))
    # The alert rules first, in this transaction (they read only their own state, never the
    # stored rows), so that what activation_norm_spike judged goes into the step rows'
    # own upsert: a separate UPDATE of 2,000 rows cost ~20 ms a batch on SQLite.
    for event in batch.events:  # before this batch's steps: they may be the new branch's
        if event.kind == "resumed" and event.step is not None:
            retire_abandoned_steps(session, run.id, event.step)
            run.resumed_at = now  # alerts started before it belong to the abandoned branch
    late = _combine_grad_norms(session, run.id, batch.steps)  # before the engine reads them
    judged = (
        evaluate_batch(session, run, batch, now=now, late_norms=late) if evaluate_alerts else []
    )
    _store_steps(session, run.id, batch.steps, judged or [])
    _store_layer_stats(session, run, batch.layer_stats)
    _apply_events(session, run, batch.events)
    for kind in DROPPED_KINDS:
        column = f"dropped_{kind}"
        setattr(run, column, getattr(run, column) + batch.dropped.get(kind, 0))
    run.last_seen_at = now
    run_version.bump(run)
    ack.alerts = firing_alerts(session, run.id)  # what this batch fired, in its transaction
    session.commit()
    return ack


def _lock_run(session: Session, batch: BatchIn, now: datetime) -> Run:
    """The batch's run, created if new, locked until this transaction ends."""
    new_run = {
        "client_run_id": batch.run.client_run_id,
        "name": batch.run.name,
        "project": batch.run.project,
        "status": "running",
        "created_at": now,
        "last_seen_at": now,
    }
    locked = (
        select(Run)
        .where(Run.project == batch.run.project, Run.client_run_id == batch.run.client_run_id)
        .with_for_update()
    )
    run = session.scalars(locked).one_or_none()
    if run is None:
        ensure_project(session, batch.run.project)  # runs.project refers to projects.name
        # DO NOTHING: a concurrent first batch of the same run may have inserted it since.
        statement = dialect_insert(session, Run)
        session.execute(statement.on_conflict_do_nothing(index_elements=RUN_KEY), new_run)
        run = session.scalars(locked).one()
    return run


#: The step row's columns, in the order `_store_steps` builds each row: the float fields
#: are bound by name from `STEP_FLOAT_FIELDS` (the one list), so a new field cannot shift
#: its neighbours' columns.
_STEP_COLUMNS = (
    "run_id", "rank", "step", "skipped", *STEP_FLOAT_FIELDS, "lr_groups", "act_threshold",
    "act_above",
)  # fmt: skip
_step_floats = attrgetter(*STEP_FLOAT_FIELDS)


def _store_steps(session: Session, run_id: int, steps: list[StepIn], judged: Judged) -> None:
    """Upsert the step rows in one statement, with activation_norm_spike's threshold and
    verdict where it judged the step (`judged`; NULL elsewhere: a row re-sent without being
    judged again loses the threshold of its old value), then refresh the rollups they touch.

    Rows are plain tuples converted as `NonFiniteFloat` would (NaN as text on SQLite):
    SQLAlchemy's per-row parameter processing cost ~10 us a row, half the time of a
    step-heavy batch in profiles.
    """
    sqlite = session.get_bind().dialect.name == "sqlite"
    bind = sqlite_float if sqlite else decode_float
    verdicts = {(rank, step): (threshold, above) for rank, step, threshold, above in judged}
    latest: dict[tuple[int, int], tuple[Any, ...]] = {}
    for record in steps:  # the last record of a (rank, step) wins, as across batches
        key = (record.rank, record.step)
        latest[key] = (
            run_id, record.rank, record.step, record.skipped,
            *map(bind, _step_floats(record)),
            None if record.lr_groups is None else record.lr_groups.astype("<f8").tobytes(),
            *verdicts.get(key, (None, None)),
        )  # fmt: skip
    if not latest:
        return
    upsert(session, Step, _STEP_COLUMNS, list(latest.values()), ("run_id", "rank", "step"))
    spans: dict[int, tuple[int, int]] = {}
    for rank, step in latest:
        first, last = spans.get(rank, (step, step))
        spans[rank] = (min(first, step), max(last, step))
    refresh_step_rollups(session, run_id, [(rank, *span) for rank, span in spans.items()])


_PART_COLUMNS = ("run_id", "step", "rank", "sumsq", "parts")
_PART_KEY = ("run_id", "step", "rank")
#: The row that receives a step's combined grad norm: the lowest rank, which the rule
#: engine follows (the parts of a step come from ranks 0..grad_parts-1).
_NORM_RANK = 0


def combined_norm(parts: list[float]) -> float:
    """sqrt of the sum of the parts (`math.fsum`: exactly rounded, so independent of their
    order); a NaN part makes it NaN, an infinite one Inf, as the loop's own norm would be.

    >>> combined_norm([9.0, 16.0]), combined_norm([1.0, math.inf]), combined_norm([1.0, math.nan])
    (5.0, inf, nan)
    """
    if any(math.isnan(p) for p in parts):
        return math.nan
    if any(math.isinf(p) for p in parts):
        return math.inf
    return math.sqrt(math.fsum(parts))


def _combine_grad_norms(session: Session, run_id: int, steps: list[StepIn]) -> list[LateNorm]:
    """Store the batch's grad-norm parts; give every step they complete its norm (see the
    module docstring). Reads the parts of the batch's steps only: (steps x world size) rows.
    Returns the norms written into rows stored by earlier batches, for the rule engine."""
    sqlite = session.get_bind().dialect.name == "sqlite"
    bind = sqlite_float if sqlite else decode_float
    latest: dict[tuple[int, int], tuple[Any, ...]] = {}
    for record in steps:
        if record.grad_sumsq is not None:
            key = (record.step, record.rank)
            latest[key] = (run_id, *key, bind(record.grad_sumsq), record.grad_parts)
    if not latest:
        return []
    upsert(session, GradNormPart, _PART_COLUMNS, list(latest.values()), _PART_KEY)
    touched = {step for step, _ in latest}
    part = GradNormPart
    in_range = (part.run_id == run_id, part.step.between(min(touched), max(touched)))
    complete = session.execute(
        select(part.step)
        .where(*in_range)
        .group_by(part.step)
        .having(func.count() == func.min(part.parts), func.min(part.parts) == func.max(part.parts))
    ).scalars()
    done = touched.intersection(complete)
    if not done:
        return []
    sums: dict[int, list[float]] = {}
    for step, sumsq in session.execute(select(part.step, part.sumsq).where(*in_range)):
        if step in done:
            sums.setdefault(step, []).append(sumsq)
    norms = {step: combined_norm(parts) for step, parts in sums.items()}
    stored = set(norms)
    for record in steps:
        if record.rank == _NORM_RANK and record.step in norms:
            record.grad_norm = encode_float(norms[record.step])  # stored and judged with it
            stored.discard(record.step)
    if not stored:
        return []
    rows = session.execute(
        select(Step.step, Step.skipped).where(
            Step.run_id == run_id, Step.rank == _NORM_RANK, Step.step.in_(sorted(stored))
        )
    )
    skipped = {step: bool(flag) for step, flag in rows}  # rank 0's rows stored earlier
    earlier = sorted(skipped)
    if not earlier:
        return []
    table = Step.__table__
    assert isinstance(table, Table)  # a mapped class's table, not a select
    statement = (
        update(table)
        .where(table.c.run_id == run_id, table.c.rank == _NORM_RANK, table.c.step == bindparam("s"))
        .values(grad_norm=bindparam("g", type_=table.c.grad_norm.type))
    )
    session.connection().execute(statement, [{"s": s, "g": norms[s]} for s in earlier])
    refresh_step_rollups(session, run_id, [(_NORM_RANK, a, b) for a, b in _runs(earlier)])
    return [(_NORM_RANK, s, norms[s], skipped[s]) for s in earlier]


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    """Sorted steps as (first, last) runs of consecutive steps.

    >>> _runs([1, 2, 3, 7, 9, 10])
    [(1, 3), (7, 7), (9, 10)]
    """
    runs: list[tuple[int, int]] = []
    for step in steps:
        if runs and runs[-1][1] == step - 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    return runs


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


def _store_layer_stats(session: Session, run: Run, records: list[LayerStatsIn]) -> None:
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


def _apply_events(session: Session, run: Run, events: list[EventIn]) -> None:
    for record in events:
        time = datetime.fromtimestamp(record.time, timezone.utc)
        session.add(
            Event(run_id=run.id, kind=record.kind, step=record.step, time=time, data=record.data)
        )
        if record.kind == "run_end":
            reason = record.data.get("reason")
            run.status = "ended"
            run.ended_at = time
            run.end_reason = str(reason)[:MAX_NAME_LENGTH] if reason is not None else None
        elif record.kind == "run_start":  # a run resumed under the same id is live again
            run.status = "running"
            run.ended_at = None
            run.end_reason = None
