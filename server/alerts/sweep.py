"""Time-based alerts: `no_data`, which no batch can raise (its cause is that none arrive).

A background worker calls `sweep(session, now)` periodically. It is idempotent and safe
with several workers: each run it might change is handled in its own short transaction
under the run's lock (the one ingest takes), re-checked after locking, and the partial
unique index on open alerts stays the last guard against a duplicate.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from ampwatch.server.alerts.config import file_rules, run_settings
from ampwatch.server.alerts.evaluate import STEPS_KEY
from ampwatch.server.alerts.lifecycle import Tracker
from ampwatch.server.alerts.rule_settings import NoData
from ampwatch.server.db import begin_write
from ampwatch.server.models import Alert, AlertConfig, AlertState, Run, utcnow

RULE = "no_data"


def sweep(session: Session, now: datetime | None = None) -> int:
    """Fire `no_data` for running runs silent beyond their `stale_seconds`; resolve it for
    runs that ended or report again. Returns how many alerts changed. Commits.

    >>> sweep(session, utcnow())  # doctest: +SKIP
    1
    """
    now = now or utcnow()
    shortest = _shortest_stale_seconds(session)
    open_no_data = select(Alert.run_id).where(
        Alert.rule == RULE, Alert.status.in_(("pending", "firing"))
    )
    candidates = session.scalars(
        select(Run.id).where(
            or_(
                Run.id.in_(open_no_data),
                (Run.status == "running") & (Run.last_seen_at < now - timedelta(seconds=shortest)),
            )
        )
    ).all()
    session.rollback()  # end the read; each run gets its own write transaction
    changed = 0
    for run_id in candidates:
        changed += _sweep_run(session, run_id, now)
    return changed


def _sweep_run(session: Session, run_id: int, now: datetime) -> int:
    begin_write(session)
    run = session.get(Run, run_id, with_for_update=True, populate_existing=True)
    if run is None:  # deleted meanwhile
        session.rollback()
        return 0
    settings = run_settings(session, project=run.project, run_id=run.id)
    rule: NoData = settings[RULE]  # type: ignore[assignment]
    state = session.get(AlertState, (run.id, STEPS_KEY))
    last_step = int(state.data.get("last_step") or 0) if state is not None else 0
    tracker = Tracker(session, run, settings, now=now, clear_since={})
    was_open = tracker.is_open(RULE)
    silent = (now - run.last_seen_at).total_seconds()
    if run.status == "running" and rule.enabled and silent > rule.stale_seconds:
        if not was_open:
            seen = run.last_seen_at.timestamp()

            def detail() -> tuple[str, dict[str, Any]]:
                return (
                    (f"no data for {silent:.0f} s (limit {rule.stale_seconds:g} s) while the "
                    f"run is not ended; last step {last_step}"),
                    {"silent_seconds": silent, "stale_seconds": rule.stale_seconds,
                     "last_seen_at": seen, "last_step": last_step},
                )  # fmt: skip

            tracker.holds(RULE, last_step, detail)
    elif was_open:
        tracker.resolve(RULE, last_step)
    if tracker.is_open(RULE) == was_open:
        session.rollback()
        return 0
    tracker.finish(last_step)
    session.commit()
    return 1


def _shortest_stale_seconds(session: Session) -> float:
    """The smallest `stale_seconds` any run may have: defaults, file, every stored
    override (a handful of rows), so one query finds every candidate run."""
    file = file_rules(session)
    layers = [file.rules, *file.projects.values()]
    layers += [dict(rules or {}) for rules in session.scalars(select(AlertConfig.rules))]
    values = [NoData().stale_seconds]
    values += [
        float(layer[RULE]["stale_seconds"])
        for layer in layers
        if "stale_seconds" in layer.get(RULE, {})
    ]
    return min(values)
