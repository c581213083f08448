"""Store one validated wire batch: all of it in one transaction, or none of it.

Idempotency: every stored batch leaves its (run, seq) in `ingested_batches`; a batch seen
before is acknowledged as a duplicate and changes nothing, so an agent may retry freely.
Within and across batches a re-sent step (or layer-stats row) overwrites the earlier one.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import numpy.typing as npt
from sqlalchemy import insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ampwatch.agent.wire import MAX_NAME_LENGTH, STEP_FLOAT_FIELDS, decode_float
from ampwatch.server.db import begin_write
from ampwatch.server.models import (
    Base,
    Event,
    IngestedBatch,
    Layer,
    LayerStat,
    Run,
    Step,
    utcnow,
)
from ampwatch.server.packed import pack_row
from ampwatch.server.schemas import BatchIn, EventIn, IngestAck, LayerStatsIn, StepIn


def ingest_batch(session: Session, batch: BatchIn, *, now: datetime | None = None) -> IngestAck:
    """Store `batch`, creating its run on first sight; returns the acknowledgement.

    Writers of one run are serialised (SQLite: one writer at a time; PostgreSQL: a row
    lock on the run), so concurrent batches of a run -- several ranks, retries racing the
    original -- cannot both claim a seq or the same new layer index.

    >>> ingest_batch(session, BatchIn.model_validate_json(body))  # doctest: +SKIP
    IngestAck(run_id=1, seq=0, duplicate=False)
    """
    now = now or utcnow()
    begin_write(session)
    run = _lock_run(session, batch, now)
    if session.get(IngestedBatch, (run.id, batch.seq)) is not None:
        session.rollback()
        return IngestAck(run_id=run.id, seq=batch.seq, duplicate=True)

    session.add(IngestedBatch(run_id=run.id, seq=batch.seq, received_at=now))
    _store_steps(session, run.id, batch.steps)
    _store_layer_stats(session, run.id, batch.layer_stats)
    _apply_events(session, run, batch.events)
    run.last_seen_at = now
    session.commit()
    return IngestAck(run_id=run.id, seq=batch.seq, duplicate=False)


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
    locked = select(Run).where(Run.client_run_id == batch.run.client_run_id).with_for_update()
    run = session.scalars(locked).one_or_none()
    if run is None:
        # DO NOTHING: a concurrent first batch of the same run may have inserted it since.
        statement = _insert(session, Run)
        session.execute(statement.on_conflict_do_nothing(index_elements=["client_run_id"]), new_run)
        run = session.scalars(locked).one()
    return run


def _store_steps(session: Session, run_id: int, steps: list[StepIn]) -> None:
    latest: dict[tuple[int, int], dict[str, Any]] = {}
    for record in steps:  # the last record of a (rank, step) wins, as across batches
        row: dict[str, Any] = {
            "run_id": run_id,
            "rank": record.rank,
            "step": record.step,
            "skipped": record.skipped,
        }
        for field in STEP_FLOAT_FIELDS:
            row[field] = decode_float(getattr(record, field))
        latest[(record.rank, record.step)] = row
    _upsert(session, Step, list(latest.values()), ("run_id", "rank", "step"))


def _store_layer_stats(session: Session, run_id: int, records: list[LayerStatsIn]) -> None:
    if not records:
        return
    layer_idx: dict[str, int] = {
        name: idx
        for name, idx in session.execute(
            select(Layer.name, Layer.idx).where(Layer.run_id == run_id)
        )
    }
    new_layers: list[dict[str, Any]] = []
    for record in records:
        for name in record.names:
            if name not in layer_idx:
                layer_idx[name] = len(layer_idx)
                new_layers.append({"run_id": run_id, "idx": layer_idx[name], "name": name})
    if new_layers:
        session.execute(insert(Layer), new_layers)

    parts: dict[
        tuple[int, str, int], list[tuple[npt.NDArray[np.intp], npt.NDArray[np.float64]]]
    ] = {}
    for record in records:
        indices = np.fromiter((layer_idx[n] for n in record.names), np.intp, len(record.names))
        for stat, values in record.stats.items():
            # The wire strings "NaN"/"Infinity"/"-Infinity" are what float() parses.
            array = np.asarray(values, dtype=np.float64)
            parts.setdefault((record.rank, stat, record.step), []).append((indices, array))
    rows = [
        {
            "run_id": run_id,
            "rank": rank,
            "stat": stat,
            "step": step,
            "values": pack_row(len(layer_idx), key_parts),
        }
        for (rank, stat, step), key_parts in parts.items()
    ]
    _upsert(session, LayerStat, rows, ("run_id", "rank", "stat", "step"))


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


def _upsert(
    session: Session, model: type[Base], rows: list[dict[str, Any]], key: Sequence[str]
) -> None:
    """INSERT ... ON CONFLICT (key) DO UPDATE: the last write of a key wins."""
    if not rows:
        return
    statement = _insert(session, model)
    updates = {
        c.name: statement.excluded[c.name] for c in model.__table__.columns if c.name not in key
    }
    session.execute(statement.on_conflict_do_update(index_elements=key, set_=updates), rows)


def _insert(session: Session, model: type[Base]) -> Any:
    """An INSERT supporting ON CONFLICT, from the session's dialect."""
    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":
        return sqlite.insert(model)
    if dialect == "postgresql":
        return postgresql.insert(model)
    raise RuntimeError(f"ampwatch stores into SQLite or PostgreSQL, not {dialect}")
