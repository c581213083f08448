"""A run's change counter (`Run.version`): every write that changes what the run's read
endpoints answer bumps it, in the write's own transaction (`bump`, `bump_where`).

Why: the dashboard polls a run's data every few seconds, and a thousand viewers of a run
that has not changed since their last poll asked the same series queries again. The
counter is read together with the run's existence check that every run route makes
already (`api.deps.existing_run_id`), so an unchanged answer is a 304 without its query
(`api.conditional`). A counter in the database, not in the process: a collector runs
several workers, and any of them may have stored the batch.

Who bumps: ingest (rows, rollups, events, dropped counts, run_start state), the alert
engine when it writes any of the run's alerts or its health (ingest or the sweep), a run's
end and resume,
threshold overrides of the run or its project (the step series carries the rule lines),
and layer aging (`layer_rollups.age_layer_stats`).
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, update
from sqlalchemy.orm import Session

from ampwatch.server.models import Run


def bump(run: Run) -> None:
    """Count a change of `run` (an ORM row of the session writing it; flushed with it)."""
    run.version = Run.version + 1  # SQL, evaluated in the UPDATE: no lost update


def bump_where(session: Session, *conditions: ColumnElement[bool]) -> None:
    """Count a change of every run matching `conditions`, in `session`'s transaction."""
    session.execute(update(Run).where(*conditions).values(version=Run.version + 1))
