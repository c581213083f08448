"""Read-side queries behind the `/api/v1/runs` endpoints, returning response models."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Select, case, distinct, func, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import STEP_FLOAT_FIELDS, WireFloat, encode_float
from ampwatch.server.models import Event, Layer, LayerStat, Run, Step
from ampwatch.server.packed import to_wire_rows, unpack_matrix
from ampwatch.server.schemas import (
    EventPublic,
    EventsPublic,
    LayerMatrix,
    RunPublic,
    RunsPublic,
    StepSeries,
)


def _runs_query() -> Select[Any]:
    # Steps are counted once however many ranks reported them.
    summary = (
        select(
            Step.run_id,
            func.count(distinct(Step.step)).label("steps"),
            func.max(Step.step).label("last_step"),
            func.count(distinct(case((Step.skipped, Step.step)))).label("skipped_steps"),
        )
        .group_by(Step.run_id)
        .subquery()
    )
    last_loss_scale = (
        select(Step.loss_scale)
        .where(Step.run_id == Run.id, Step.step == summary.c.last_step)
        .order_by(Step.rank)
        .limit(1)
        .scalar_subquery()
    )
    return (
        select(
            Run,
            summary.c.steps,
            summary.c.last_step,
            summary.c.skipped_steps,
            last_loss_scale.label("last_loss_scale"),
        )
        .outerjoin(summary, summary.c.run_id == Run.id)
        .order_by(Run.created_at.desc(), Run.id.desc())
    )


def _run_public(run: Run, steps: Any, last_step: Any, skipped: Any, scale: Any) -> RunPublic:
    return RunPublic(
        id=run.id,
        client_run_id=run.client_run_id,
        name=run.name,
        project=run.project,
        status=run.status,
        created_at=run.created_at,
        last_seen_at=run.last_seen_at,
        steps=steps or 0,
        last_step=last_step,
        last_loss_scale=encode_float(scale),
        skipped_steps=skipped or 0,
    )


def list_runs(session: Session) -> RunsPublic:
    """All runs, newest first, each with its step summary."""
    return RunsPublic(runs=[_run_public(*row) for row in session.execute(_runs_query())])


def get_run(session: Session, run_id: int) -> RunPublic | None:
    """One run with its step summary, or None when there is no such run."""
    row = session.execute(_runs_query().where(Run.id == run_id)).first()
    return _run_public(*row) if row else None


def _wire_column(values: Iterable[float | None]) -> list[WireFloat | None]:
    return [v if v is None or math.isfinite(v) else encode_float(v) for v in values]


def step_series(session: Session, run_id: int, rank: int) -> StepSeries:
    """The steps of one rank as columns, ordered by step."""
    columns = [getattr(Step, name) for name in STEP_FLOAT_FIELDS]
    rows = session.execute(
        select(Step.step, Step.skipped, *columns)
        .where(Step.run_id == run_id, Step.rank == rank)
        .order_by(Step.step)
    ).all()
    transposed = list(zip(*rows)) or [()] * (2 + len(columns))
    floats = {name: _wire_column(column) for name, column in zip(STEP_FLOAT_FIELDS, transposed[2:])}
    return StepSeries(step=list(transposed[0]), skipped=list(transposed[1]), **floats)


def layer_matrix(session: Session, run_id: int, stat: str, rank: int) -> LayerMatrix:
    """One statistic for every layer of a run: rows by step, columns by layer idx."""
    names = list(
        session.scalars(select(Layer.name).where(Layer.run_id == run_id).order_by(Layer.idx))
    )
    rows = session.execute(
        select(LayerStat.step, LayerStat.values)
        .where(LayerStat.run_id == run_id, LayerStat.rank == rank, LayerStat.stat == stat)
        .order_by(LayerStat.step)
    ).all()
    values, missing = unpack_matrix([blob for _, blob in rows], len(names))
    return LayerMatrix(
        stat=stat,
        layers=names,
        steps=[step for step, _ in rows],
        values=to_wire_rows(values, missing),
    )


def run_events(session: Session, run_id: int) -> EventsPublic:
    """A run's events in time order (ties in arrival order)."""
    events = session.scalars(
        select(Event).where(Event.run_id == run_id).order_by(Event.time, Event.id)
    )
    return EventsPublic(
        events=[
            EventPublic(kind=e.kind, step=e.step, time=e.time.timestamp(), data=e.data)
            for e in events
        ]
    )


def run_exists(session: Session, run_id: int) -> bool:
    return session.get(Run, run_id) is not None
