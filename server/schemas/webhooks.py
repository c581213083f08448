"""Webhooks and their deliveries (`ampwatch.server.api.webhooks`)."""

from __future__ import annotations

from datetime import datetime

from pydantic import (
    BaseModel,
    ConfigDict,
    field_validator,
)

from ampwatch.server.models import Severity, WebhookFormat
from ampwatch.server.schemas.wire import Name

#: Longest webhook URL stored (`webhooks.url`).
MAX_URL_LENGTH = 2048


class WebhookCreate(BaseModel):
    """A webhook to post alert transitions to.

    `project`: whose alerts; a project token may name only its own (the default for it),
    an admin may omit it for every project's. `min_severity`: the least severe alert sent.
    """

    model_config = ConfigDict(extra="forbid")

    url: str
    format: WebhookFormat = "generic"
    project: Name | None = None
    min_severity: Severity = "warning"

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        from urllib.parse import urlsplit

        url = url.strip()
        if len(url) > MAX_URL_LENGTH:
            raise ValueError(f"url is longer than {MAX_URL_LENGTH} characters")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError on a malformed port
        except ValueError as error:
            raise ValueError(f"url is not a valid URL: {error}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("url must be an http:// or https:// URL with a host")
        if any(ch.isspace() or ord(ch) < 32 for ch in url):
            raise ValueError("url must not contain spaces or control characters")
        return url


class WebhookPublic(BaseModel):
    id: int
    url: str
    format: WebhookFormat
    #: null: every project's alerts (created by an admin).
    project: str | None
    min_severity: Severity
    enabled: bool
    created_at: datetime


class WebhooksPublic(BaseModel):
    webhooks: list[WebhookPublic]


class DeliveryPublic(BaseModel):
    """One notification to a webhook: its delivery state and last attempt's outcome."""

    id: int
    alert_id: int
    run_id: int
    rule: str
    severity: Severity
    transition: str
    status: str
    attempts: int
    next_attempt_at: datetime
    last_error: str | None
    response_status: int | None
    created_at: datetime
    delivered_at: datetime | None


class DeliveriesPublic(BaseModel):
    """A webhook's delivery log, newest first."""

    deliveries: list[DeliveryPublic]


class WebhookTestResult(BaseModel):
    """What the webhook answered to a test message (sent at once, not queued)."""

    delivered: bool
    response_status: int | None
    error: str | None
