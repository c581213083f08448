"""The run page's HTML parts around its charts: the header's facts, the alerts with
their explanations, and the checkpoints with the restart advisor's verdicts.
"""

from __future__ import annotations

from datetime import datetime, timezone

from dash import html

from ampwatch.dashboard import alert_figures, figure_common, loss_scale_figures
from ampwatch.dashboard.pages.runs import age_seconds, format_age, format_rate, health_badge
from ampwatch.dashboard.run_types import Alert, RestartAdvice, RunEvent, RunSummary


def run_header(run: RunSummary) -> html.Div:
    facts = [
        ("project", run.project),
        ("status", run.status),
        ("last step", "—" if run.last_step is None else f"{run.last_step:,}"),
        ("loss scale", figure_common.format_loss_scale(run.last_loss_scale)),
        ("skip rate (last ~1k steps)", format_rate(run.skip_rate)),
        ("skipped steps", f"{run.skipped_steps:,}"),
        ("last data", format_age(age_seconds(run, datetime.now(timezone.utc)))),
    ]
    return html.Div(
        [
            html.Div([html.H2(run.name), health_badge(run.health)], className="title-row"),
            html.Dl(
                # One group per fact, so a wrapping line never parts a label from its value.
                [html.Div([html.Dt(label), html.Dd(value)]) for label, value in facts],
                className="facts",
                title=f"last data {figure_common.format_time(run.last_seen_at)}",
            ),
        ]
    )


def hidden_note(hidden: dict[str, int]) -> str:
    """'and 470 more: underflow_risk × 468, skip_rate × 2' (empty when nothing is hidden)."""
    if not hidden:
        return ""
    rules = ", ".join(f"{rule} × {n}" for rule, n in sorted(hidden.items(), key=lambda i: -i[1]))
    return f"and {sum(hidden.values()):,} more: {rules}"


def alerts_list(alerts: list[Alert] | None, hidden: dict[str, int] | None = None) -> html.Div:
    """Each alert with what it says and the values that triggered it, in `select_alerts`
    order, then how many more there are."""
    if alerts is None:
        return html.Div(html.P("Alerts are not available on this collector.", className="muted"))
    items = []
    for alert in alerts:
        steps = " → ".join(
            f"{label} {step:,}"
            for label, step in (
                ("started", alert.started_step),
                ("fired", alert.fired_step),
                ("resolved", alert.resolved_step),
            )
            if step is not None
        )
        values = ", ".join(f"{k} = {v}" for k, v in alert.values.items())
        items.append(
            html.Li(
                [
                    html.Span(alert.severity, className=f"badge health-{alert.severity}"),
                    html.Span(alert.status, className=f"badge status-{alert.status}"),
                    html.B(alert_figures.alert_label(alert)),
                    html.Span(f" ({steps})" if steps else "", className="muted"),
                    html.Div(alert.message, className="message"),
                    html.Div(values, className="values muted") if values else None,
                ],
                className=f"alert alert-{alert.status}",
            )
        )
    note = hidden_note(hidden or {})
    return html.Div(
        [
            html.Ul(items, className="alerts") if items else None,
            html.P(note, className="muted") if note else None,
        ]
    )


def checkpoints_table(advice: RestartAdvice | None, events: list[RunEvent]) -> html.Div:
    """The advisor's candidates with verdicts and reasons, the recommended one highlighted;
    without an advisor, the checkpoints the agent reported."""
    if advice is None:
        reported = [e for e in events if e.kind == "checkpoint"]
        note = html.P(
            "The restart advisor is not available on this collector; these are the "
            "checkpoints the agent reported.",
            className="muted",
        )
        if not reported:
            return html.Div([note, html.P("No checkpoint reported yet.")])
        rows = [
            html.Tr(
                [
                    html.Td("—" if e.step is None else f"{e.step:,}", className="num"),
                    html.Td(str(e.data.get("path", ""))),
                ]
            )
            for e in reported
        ]
        return html.Div(
            [
                note,
                html.Table(
                    [html.Thead(html.Tr([html.Th("step"), html.Th("path")])), html.Tbody(rows)],
                    className="runs",
                ),
            ]
        )
    summary = []
    if advice.recommended_step is not None:
        summary.append(
            html.Span(f"Restart from step {advice.recommended_step:,}.", className="recommend")
        )
    else:
        summary.append(
            html.Span("No checkpoint qualifies as a healthy restart point.", className="error")
        )
    if advice.onset_step is not None:
        summary.append(
            html.Span(
                f" Incident onset at step {advice.onset_step:,}"
                + (f" ({advice.onset_rule})" if advice.onset_rule else "")
                + (f"; margin {advice.margin_steps:,} steps." if advice.margin_steps else ".")
            )
        )
    if not advice.candidates:
        return html.Div([html.P(summary), html.P("No checkpoint reported yet.")])
    header = html.Thead(
        html.Tr([html.Th(t) for t in ("step", "verdict", "why", "loss scale", "act norm", "path")])
    )
    rows = [
        html.Tr(
            [
                html.Td("—" if c.step is None else f"{c.step:,}", className="num"),
                html.Td(
                    ("★ " if c.verdict == loss_scale_figures.RECOMMENDED else "") + c.verdict,
                    className=f"verdict-{c.verdict}",
                ),
                html.Td("; ".join(c.reasons)),
                html.Td(figure_common.format_loss_scale(c.loss_scale), className="num"),
                html.Td("—" if c.act_norm is None else f"{c.act_norm:.4g}", className="num"),
                html.Td(c.path or ""),
            ],
            className=f"candidate-{c.verdict}",
        )
        for c in advice.candidates
    ]
    return html.Div(
        [html.P(summary), html.Table([header, html.Tbody(rows)], className="runs checkpoints")]
    )
