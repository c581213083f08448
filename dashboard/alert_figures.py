"""The alerts timeline: one row per alert (rule, and layer when it has one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from ampwatch.dashboard.figure_common import (
    MARGIN,
    SEVERITY_COLORS,
    STEP_AXIS_TITLE,
    _title,
    _x_axis,
    empty_figure,
    figure_of,
)
from ampwatch.dashboard.heatmap_figures import label_margin, row_ticks
from ampwatch.dashboard.run_types import Alert


def alert_label(alert: Alert) -> str:
    return alert.rule if alert.layer is None else f"{alert.rule} · {alert.layer}"


def alerts_timeline_figure(
    alerts: Sequence[Alert] | None,
    last_step: int | None,
    *,
    x_range: Sequence[int] | None = None,
    note: str = "",
) -> go.Figure:
    """Every alert as a bar over the steps it was active (start → resolved, or the last
    step while it still fires), one row per rule and layer, coloured by severity; a
    diamond marks the step it fired. Pending alerts are pale. `x_range`: the run's steps,
    so the timeline lines up with the charts above it; `note`: alerts not drawn."""
    title = "Alerts"
    if alerts is None:
        return empty_figure(title, "This collector has no alert engine.")
    if not alerts:
        return empty_figure(title, "No alert has fired for this run.")
    data: list[dict[str, Any]] = []
    for severity, color in SEVERITY_COLORS.items():
        chosen = [a for a in alerts if a.severity == severity]
        if not chosen:
            continue
        starts = [
            a.started_step if a.started_step is not None else a.fired_step or 0 for a in chosen
        ]
        ends = [
            a.resolved_step if a.resolved_step is not None else (last_step or start)
            for a, start in zip(chosen, starts, strict=True)
        ]
        data.append(
            {
                "type": "bar",
                "orientation": "h",
                "base": starts,
                "x": [max(end - start, 1) for start, end in zip(starts, ends, strict=True)],
                "y": [alert_label(a) for a in chosen],
                "name": severity,
                "marker": {
                    "color": color,
                    "opacity": [0.35 if a.status == "pending" else 0.85 for a in chosen],
                },
                "customdata": [[a.status, a.message] for a in chosen],
                "hovertemplate": "%{y}<br>%{customdata[0]}: %{customdata[1]}<extra></extra>",
            }
        )
    fired = [a for a in alerts if a.fired_step is not None]
    if fired:
        data.append(
            {
                "type": "scatter",
                "x": [a.fired_step for a in fired],
                "y": [alert_label(a) for a in fired],
                "mode": "markers",
                "name": "fired",
                "marker": {"symbol": "diamond", "size": 10, "color": "#111827"},
                "hovertemplate": "fired at step %{x}<extra></extra>",
            }
        )
    rows = list(dict.fromkeys(alert_label(a) for a in alerts))
    return figure_of(
        data,
        {
            "title": _title(title, note or None),
            "height": 140 + 36 * len(rows),
            "barmode": "overlay",
            "hovermode": "closest",
            "margin": {**MARGIN, "t": 80, "l": label_margin(rows)},
            "xaxis": _x_axis(x_range, title={"text": STEP_AXIS_TITLE}),
            "yaxis": {"autorange": "reversed", **row_ticks(rows, most=len(rows))},
        },
    )
