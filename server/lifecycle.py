"""Run lifecycle writes behind `/api/v1/runs`: create or resume, end, delete.

Each is one transaction started as a writer (`begin_write`), so on SQLite it waits for the
write lock instead of failing, and on PostgreSQL the run row is locked as ingest locks it:
ending or deleting a run and ingesting into it are serialised, never interleaved.
Callers check the caller's project first (`ampwatch.server.auth`).
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ampwatch.server import run_version
from ampwatch.server.auth import ensure_project
from ampwatch.server.db import begin_write, dialect_insert
from ampwatch.server.models import RUN_KEY, Run, utcnow


def create_or_resume(
    session: Session, *, client_run_id: str, name: str, project: str
) -> tuple[int, bool]:
    """The id of `project`'s run `client_run_id` and whether this call created it.

    An existing run is resumed: running again, its end cleared, as a `run_start` event
    does on ingest; its name and project stay as first registered.

    >>> create_or_resume(session, client_run_id="3f2a", name="gpt", project="nlp")  # doctest: +SKIP
    (1, True)
    """
    now = utcnow()
    begin_write(session)
    ensure_project(session, project)
    inserted = session.execute(
        dialect_insert(session, Run)
        .values(
            client_run_id=client_run_id,
            name=name,
            project=project,
            status="running",
            created_at=now,
            last_seen_at=now,
        )
        .on_conflict_do_nothing(index_elements=RUN_KEY)
        .returning(Run.id)  # a row comes back only when this call inserted it
    )
    created = inserted.first() is not None
    run = session.scalars(
        select(Run)
        .where(Run.project == project, Run.client_run_id == client_run_id)
        .with_for_update()
    ).one()
    if not created:
        run.status = "running"
        run.ended_at = None
        run.end_reason = None
        run.last_seen_at = now
        run_version.bump(run)
    session.commit()
    return run.id, created


def end_run(session: Session, run_id: int, *, reason: str | None = None) -> bool:
    """Mark run `run_id` ended now (an ended run keeps its first end); False if gone."""
    begin_write(session)
    run = session.get(Run, run_id, with_for_update=True)
    if run is None:
        session.rollback()
        return False
    if run.status != "ended":
        run.status = "ended"
        run.ended_at = utcnow()
        run.end_reason = reason
        run_version.bump(run)
    session.commit()
    return True


def delete_run(session: Session, run_id: int) -> bool:
    """Delete run `run_id` and all its data in one transaction; False if already gone.

    Steps, layers, statistics, histograms, events and batch records go by the foreign
    keys' ON DELETE CASCADE (SQLite enforces them: `db.make_engine` turns them on).
    """
    begin_write(session)
    deleted = session.execute(delete(Run).where(Run.id == run_id).returning(Run.project))
    project = deleted.scalar_one_or_none()
    if project is not None:  # its alerts went with it: the alert lists changed
        run_version.note_project_alerts(session, project)
    session.commit()
    return project is not None
