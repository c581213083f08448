"""`/api/v1/webhooks`: where alert transitions are posted, and each one's delivery log.

A project token creates, sees and removes only its project's webhooks; an admin sees all,
and may create one without a project, which receives every project's alerts. Deliveries
are made by the notification worker (`ampwatch.server.webhook_delivery`), never by these routes,
except `/test`, which posts at once so the caller learns whether the URL works.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server import webhook_delivery
from ampwatch.server.api.deps import NOT_YOURS, PrincipalDep, SessionDep, SessionRoute, SettingsDep
from ampwatch.server.auth import AuthError, Principal, ensure_project
from ampwatch.server.db import begin_write
from ampwatch.server.models import Alert, Notification, Webhook, utcnow
from ampwatch.server.schemas.errors import ErrorPublic
from ampwatch.server.schemas.webhooks import (
    DeliveriesPublic,
    DeliveryPublic,
    WebhookCreate,
    WebhookPublic,
    WebhooksPublic,
    WebhookTestResult,
)
from ampwatch.server.schemas.wire import MAX_INT

router = APIRouter(
    route_class=SessionRoute, prefix="/webhooks", tags=["webhooks"], responses=NOT_YOURS
)

WEBHOOK_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorPublic, "description": "No such webhook"}
}
DEFAULT_DELIVERIES = 100
MAX_DELIVERIES = 1000


def _public(hook: Webhook) -> WebhookPublic:
    return WebhookPublic.model_validate(hook, from_attributes=True)


def _visible_webhook(session: Session, principal: Principal, webhook_id: int) -> Webhook:
    """The webhook, if this caller may manage it: 404 when unknown, 403 when another
    project's (or, for a project token, an admin's global one)."""
    hook = session.get(Webhook, webhook_id) if 1 <= webhook_id <= MAX_INT else None
    if hook is None:
        raise HTTPException(status_code=404, detail=f"webhook {webhook_id} not found")
    if hook.project is None and not principal.is_admin:
        raise AuthError(403, f"webhook {webhook_id} serves every project; only an admin may use it")
    if hook.project is not None:
        principal.check_project(hook.project)
    return hook


@router.post("", status_code=201)
def create_webhook(
    body: WebhookCreate, session: SessionDep, principal: PrincipalDep
) -> WebhookPublic:
    """Add a webhook. A project token's webhook is for its own project."""
    project = body.project if body.project is not None else principal.project
    if project is not None:
        principal.check_project(project)
    begin_write(session)
    if project is not None:
        ensure_project(session, project)  # a webhook may be set up before the first run
    hook = Webhook(
        url=body.url,
        format=body.format,
        project=project,
        min_severity=body.min_severity,
        enabled=True,
        created_at=utcnow(),
    )
    session.add(hook)
    session.commit()
    return _public(hook)


@router.get("")
def list_webhooks(
    session: SessionDep,
    principal: PrincipalDep,
    project: Annotated[
        str | None, Query(description="Only this project's webhooks (a project token: its own).")
    ] = None,
) -> WebhooksPublic:
    """Webhooks oldest first: a project token's own project's; an admin's, every one."""
    if project is not None:
        principal.check_project(project)
    scope = project if project is not None else principal.project
    statement = select(Webhook).order_by(Webhook.id)
    if scope is not None:
        statement = statement.where(Webhook.project == scope)
    return WebhooksPublic(webhooks=[_public(hook) for hook in session.scalars(statement)])


@router.delete("/{webhook_id}", status_code=204, responses=WEBHOOK_ERRORS)
def delete_webhook(webhook_id: int, session: SessionDep, principal: PrincipalDep) -> Response:
    """Remove a webhook and its delivery log (queued notifications are dropped)."""
    begin_write(session)
    session.delete(_visible_webhook(session, principal, webhook_id))
    session.commit()
    return Response(status_code=204)


@router.get("/{webhook_id}/deliveries", responses=WEBHOOK_ERRORS)
def list_deliveries(
    webhook_id: int,
    session: SessionDep,
    principal: PrincipalDep,
    limit: Annotated[
        int, Query(ge=1, le=MAX_DELIVERIES, description="Most deliveries returned.")
    ] = DEFAULT_DELIVERIES,
) -> DeliveriesPublic:
    """The webhook's notifications, newest first, with each one's last attempt."""
    _visible_webhook(session, principal, webhook_id)
    rows = session.execute(
        select(Notification, Alert.run_id, Alert.rule, Alert.severity)
        .join(Alert, Alert.id == Notification.alert_id)
        .where(Notification.webhook_id == webhook_id)
        .order_by(Notification.created_at.desc(), Notification.id.desc())
        .limit(limit)
    ).all()
    return DeliveriesPublic(
        deliveries=[
            DeliveryPublic(
                id=note.id,
                alert_id=note.alert_id,
                run_id=run_id,
                rule=rule,
                severity=severity,
                transition=note.transition,
                status=note.status,
                attempts=note.attempts,
                next_attempt_at=note.next_attempt_at,
                last_error=note.last_error,
                response_status=note.response_status,
                created_at=note.created_at,
                delivered_at=note.delivered_at,
            )
            for note, run_id, rule, severity in rows
        ]
    )


@router.post("/{webhook_id}/test", responses=WEBHOOK_ERRORS)
def post_test_message(
    webhook_id: int, session: SessionDep, principal: PrincipalDep, settings: SettingsDep
) -> WebhookTestResult:
    """Post a test message now (within the webhook timeout) and say what came back.

    Sent directly rather than queued: it announces no alert, and the point is the answer.
    """
    hook = _visible_webhook(session, principal, webhook_id)
    session.expunge(hook)
    session.rollback()  # no transaction held open across the POST
    outcome = webhook_delivery.send_test(hook, settings)
    return WebhookTestResult(
        delivered=outcome.delivered, response_status=outcome.status, error=outcome.error
    )
