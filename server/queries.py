"""Read-side queries behind the `/api/v1/runs` endpoints, returning response models."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Select, case, distinct, func, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import DROPPED_KINDS, encode_float
from ampwatch.server.models import Event, Run, RunStatus, Step
from ampwatch.server.schemas import (
    EventPublic,
    EventsPublic,
    RunPublic,
    RunsPublic,
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
        dropped={kind: getattr(run, f"dropped_{kind}") for kind in DROPPED_KINDS},
    )


def list_runs(
    session: Session,
    *,
    project: str | None = None,
    status: RunStatus | None = None,
    name_contains: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> RunsPublic:
    """One page of the runs matching every given filter, newest first, with the total.

    `name_contains` matches anywhere in the name, case-insensitively (ASCII case on SQLite).
    """
    conditions: list[ColumnElement[bool]] = []
    if project is not None:
        conditions.append(Run.project == project)
    if status is not None:
        conditions.append(Run.status == status)
    if name_contains:
        pattern = name_contains.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        conditions.append(Run.name.ilike(f"%{pattern}%", escape="\\"))
    total = session.scalar(select(func.count()).select_from(Run).where(*conditions)) or 0
    page = _runs_query().where(*conditions).limit(limit).offset(offset)
    return RunsPublic(
        runs=[_run_public(*row) for row in session.execute(page)],
        total=total,
        limit=limit,
        offset=offset,
    )


def get_run(session: Session, run_id: int) -> RunPublic | None:
    """One run with its step summary, or None when there is no such run."""
    row = session.execute(_runs_query().where(Run.id == run_id)).first()
    return _run_public(*row) if row else None


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
