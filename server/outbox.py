"""The alert notifications' outbox: `enqueue` writes one row per webhook that wants an
alert's transition, inside the transaction that changed the alert (the alert engine's
`Tracker` calls it), so a transition is never lost: it is committed with the alert it
announces. `ampwatch.server.webhook_delivery` delivers the rows later.
"""

from __future__ import annotations

from typing import Literal

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from ampwatch.server.models import SEVERITIES, Alert, Notification, Run, Webhook, utcnow

Transition = Literal["firing", "resolved"]

#: Set in `session.info` when `enqueue` queued a row: the ingest process then wakes its
#: delivery worker (`webhook_delivery.DeliveryWorker.wake`) once the batch committed.
QUEUED_KEY = "ampwatch.notifications_queued"


def enqueue(session: Session, alert: Alert, transition: Transition) -> int:
    """Queue one notification of `alert`'s `transition` per enabled webhook that wants it
    (its project's or a global one, at or above its minimum severity); returns how many.

    Call inside the transaction that changed the alert; the caller commits."""
    project = session.scalar(select(Run.project).where(Run.id == alert.run_id))
    wanted = SEVERITIES[: SEVERITIES.index(alert.severity) + 1]
    hooks = session.scalars(
        select(Webhook.id).where(
            Webhook.enabled.is_(True),
            or_(Webhook.project.is_(None), Webhook.project == project),
            Webhook.min_severity.in_(wanted),
        )
    ).all()
    now = utcnow()
    session.add_all(
        Notification(
            alert_id=alert.id,
            webhook_id=hook,
            transition=transition,
            status="pending",
            attempts=0,
            next_attempt_at=now,
            created_at=now,
        )
        for hook in hooks
    )
    if hooks:
        session.info[QUEUED_KEY] = True
    return len(hooks)
