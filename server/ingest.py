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

A sharded step's grad-norm parts are combined first (`ampwatch.server.grad_norm_parts`),
the layer records stored packed (`ampwatch.server.layer_ingest`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from operator import attrgetter
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import DROPPED_KINDS, MAX_NAME_LENGTH, STEP_FLOAT_FIELDS, decode_float
from ampwatch.server import run_version
from ampwatch.server.alerts import evaluate_batch
from ampwatch.server.alerts.evaluate import Judged
from ampwatch.server.auth import ensure_project
from ampwatch.server.column_types import sqlite_float
from ampwatch.server.db import begin_write, dialect_insert, upsert
from ampwatch.server.firing import firing_alerts
from ampwatch.server.grad_norm_parts import combine_grad_norms
from ampwatch.server.layer_ingest import store_layer_stats
from ampwatch.server.models import RUN_KEY, Event, IngestedBatch, Run, utcnow
from ampwatch.server.rollback import retire_abandoned_steps
from ampwatch.server.rollups import refresh_step_rollups
from ampwatch.server.schemas.runs import IngestAck
from ampwatch.server.schemas.wire import BatchIn, EventIn, StepIn
from ampwatch.server.step_models import Step


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
    late = combine_grad_norms(session, run.id, batch.steps)  # before the engine reads them
    judged = (
        evaluate_batch(session, run, batch, now=now, late_norms=late) if evaluate_alerts else []
    )
    _store_steps(session, run.id, batch.steps, judged or [])
    store_layer_stats(session, run, batch.layer_stats)
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
