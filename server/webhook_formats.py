"""What a notification says, per webhook format (`render`).

- `slack`: a Slack incoming-webhook message: `text` (complete on its own, for chat tools
  that ignore blocks) plus `blocks` (header, fields, message, link to the run page); text
  from the run and the alert is escaped (`slack_escape`) so it cannot mention or link.
- `generic`: `{"version": 1, "kind": "alert" | "test", "notification_id" (the same on
  every retry: receivers deduplicate on it), "attempt" (1, 2, ...), "transition":
  "firing" | "resolved", "alert": {id, rule, layer, severity, status, started_step,
  fired_step, resolved_step, started_at, fired_at, resolved_at, message, values}, "run":
  {id, client_run_id, name, project, url}, "project", "sent_at"}`; times ISO 8601 UTC,
  non-finite floats in `values` in the wire encoding ("NaN", "Infinity").
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from ampwatch.agent.wire import DASHBOARD_PREFIX
from ampwatch.server.models import Alert, Run, Webhook, utcnow
from ampwatch.server.settings import Settings

GENERIC_VERSION = 1
_SEVERITY_ICONS = {
    "info": ":information_source:",
    "warning": ":warning:",
    "critical": ":rotating_light:",
}


@dataclass(frozen=True)
class Message:
    """Everything a body is made of, read while the notification is claimed."""

    notification_id: int | None
    kind: Literal["alert", "test"]
    transition: str
    alert: dict[str, Any]
    run: dict[str, Any]
    project: str | None
    #: 1 for the first try of this notification, 2 for the first retry, ...
    attempt: int = 1


def run_page_url(settings: Settings, run_id: int) -> str:
    """The dashboard page of run `run_id`: under `dashboard_url` when the dashboard runs on
    its own, else under the collector's `public_url`, where it is mounted."""
    base = settings.dashboard_url or settings.public_url + DASHBOARD_PREFIX
    return f"{base.rstrip('/')}/run/{run_id}"


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def alert_message(
    notification_id: int | None,
    transition: str,
    alert: Alert,
    run: Run,
    settings: Settings,
    *,
    attempt: int = 1,
) -> Message:
    return Message(
        attempt=attempt,
        notification_id=notification_id,
        kind="alert",
        transition=transition,
        alert={
            "id": alert.id,
            "rule": alert.rule,
            "layer": alert.layer,
            "severity": alert.severity,
            "status": alert.status,
            "started_step": alert.started_step,
            "fired_step": alert.fired_step,
            "resolved_step": alert.resolved_step,
            "started_at": _iso(alert.started_at),
            "fired_at": _iso(alert.fired_at),
            "resolved_at": _iso(alert.resolved_at),
            "message": alert.message,
            "values": alert.values,
        },
        run={
            "id": run.id,
            "client_run_id": run.client_run_id,
            "name": run.name,
            "project": run.project,
            "url": run_page_url(settings, run.id),
        },
        project=run.project,
    )


def sample_message(webhook: Webhook) -> Message:
    """A harmless message that shows what an alert will look like at `webhook`."""
    return Message(
        notification_id=None,
        kind="test",
        transition="firing",
        alert={
            "id": None,
            "rule": "test",
            "layer": "",
            "severity": "info",
            "status": "firing",
            "started_step": None,
            "fired_step": None,
            "resolved_step": None,
            "started_at": None,
            "fired_at": None,
            "resolved_at": None,
            "message": f"test message for webhook {webhook.id}: ampwatch can reach this URL",
            "values": {},
        },
        run={},
        project=webhook.project,
    )


def generic_body(message: Message, *, sent_at: datetime | None = None) -> dict[str, Any]:
    """The `generic` JSON body (layout in the module docstring)."""
    return {
        "version": GENERIC_VERSION,
        "kind": message.kind,
        "notification_id": message.notification_id,
        "attempt": message.attempt,
        "transition": message.transition,
        "alert": message.alert,
        "run": message.run,
        "project": message.project,
        "sent_at": (sent_at or utcnow()).isoformat(),
    }


def slack_escape(text: str) -> str:
    """`text` as Slack shows it literally: its three control characters escaped (Slack's
    "Escaping text" rules), so a run named `<!channel>` pings no one and `<http://x|y>`
    in a finding is no disguised link.

    >>> slack_escape("<!channel> & <http://evil|docs>")
    '&lt;!channel&gt; &amp; &lt;http://evil|docs&gt;'
    """
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_body(message: Message) -> dict[str, Any]:
    """A Slack incoming-webhook body: `text` says it all; `blocks` lay it out. Everything
    a run or an alert contributes is escaped (`slack_escape`); the header block is
    plain text, which Slack never parses."""
    alert, run = message.alert, message.run
    severity = str(alert["severity"])
    state = "RESOLVED" if message.transition == "resolved" else severity.upper()
    step = alert["resolved_step"] if message.transition == "resolved" else alert["fired_step"]
    step = step if step is not None else alert.get("started_step")
    at_step = f" at step {step}" if step is not None else ""
    run_name = str(run.get("name") or "(test)")
    layer = str(alert.get("layer") or "")
    rule = str(alert["rule"])

    def headline_of(escape: Any) -> str:
        where = f" on layer `{escape(layer)}`" if layer else ""
        return (
            f"[{state}] {escape(rule)} {message.transition} on run {escape(run_name)}"
            f"{where}{at_step}"
        )

    headline = headline_of(slack_escape)
    finding = slack_escape(str(alert["message"]))
    text = f"{headline}: {finding}"
    if run.get("url"):
        text += f" <{run['url']}|open run>"
    fields = [
        ("Run", f"{slack_escape(run_name)} (id {run['id']})" if run else "(test)"),
        ("Project", slack_escape(message.project or "(every project)")),
        ("Rule", slack_escape(rule)),
        ("Severity", severity),
        ("Layer", slack_escape(layer) if layer else "(whole run)"),
        ("Step", str(step) if step is not None else "-"),
    ]
    blocks: list[dict[str, Any]] = [
        {
            "type": "header",
            "text": {"type": "plain_text", "text": headline_of(str)[:150]},
        },
        {
            "type": "section",
            "fields": [{"type": "mrkdwn", "text": f"*{name}*\n{value}"} for name, value in fields],
        },
        {
            "type": "section",
            "text": {
                "type": "mrkdwn",
                "text": f"{_SEVERITY_ICONS.get(severity, '')} {finding}"[:3000],
            },
        },
    ]
    if run.get("url"):
        link = {"type": "mrkdwn", "text": f"<{run['url']}|Open the run in ampwatch>"}
        blocks.append({"type": "context", "elements": [link]})
    return {"text": text, "blocks": blocks}


def render(message: Message, body_format: str) -> dict[str, Any]:
    return slack_body(message) if body_format == "slack" else generic_body(message)
