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

A run's alerts counter (`Run.alerts_version`) tags its alerts page, which its change
counter would retag with every batch (under `bench/load.py`'s 32 agents ~40% of the
batches wrote an alert), and a project's (`Project.alerts_version`) the alerts across its
runs. Who counts an alert write (`bump_alerts`): the alert engine
(`alerts.lifecycle.Tracker.finish`) and a precursor's lead stamp (`alerts.precursors`);
a run's deletion counts one of its project's (`lifecycle.delete_run`). The project's
counter is bumped at the transaction's commit, in it (`_bump_noted`): the alerts and
their count are seen together, and PostgreSQL holds the project row's lock for the commit
alone, not for the rest of a batch's work, while the other agents of the project write
theirs.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, event, update
from sqlalchemy.orm import Session, SessionTransaction

from ampwatch.server.models import Project, Run

#: `Session.info` key: the projects whose alerts this transaction wrote.
_ALERTS_CHANGED = "ampwatch.alerts_changed"


def bump(run: Run) -> None:
    """Count a change of `run` (an ORM row of the session writing it; flushed with it)."""
    run.version = Run.version + 1  # SQL, evaluated in the UPDATE: no lost update


def bump_where(session: Session, *conditions: ColumnElement[bool]) -> None:
    """Count a change of every run matching `conditions`, in `session`'s transaction."""
    session.execute(update(Run).where(*conditions).values(version=Run.version + 1))


def bump_alerts(session: Session, run: Run) -> None:
    """Count a change of `run`'s alerts (an ORM row of `session`, flushed with it) and of
    its project's (`note_project_alerts`)."""
    run.alerts_version = Run.alerts_version + 1  # SQL, evaluated in the UPDATE
    note_project_alerts(session, run.project)


def note_project_alerts(session: Session, project: str) -> None:
    """Count a change of `project`'s alerts when `session`'s transaction commits; call it
    in the transaction that wrote them."""
    session.info.setdefault(_ALERTS_CHANGED, set()).add(project)


@event.listens_for(Session, "before_commit")
def _bump_noted(session: Session) -> None:
    """Bump the alerts counter of each project noted in the committing transaction."""
    noted = session.info.pop(_ALERTS_CHANGED, None)
    for project in sorted(noted or ()):  # one order: two commits never wait on each other
        session.execute(
            update(Project)
            .where(Project.name == project)
            .values(alerts_version=Project.alerts_version + 1)
        )


@event.listens_for(Session, "after_transaction_end")
def _forget_noted(session: Session, transaction: SessionTransaction) -> None:
    """Notes live as long as their transaction: a rolled-back one wrote no alerts (a
    savepoint's end keeps them: some may be of writes before it)."""
    if transaction.parent is None and not transaction.nested:
        session.info.pop(_ALERTS_CHANGED, None)
