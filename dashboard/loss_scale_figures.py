"""The run page's first chart: the loss scale on a log2 axis over the loss, with skipped
steps, the scale lines the run's rules judge by, checkpoints with the restart advisor's
verdicts, the spans of run-wide alerts and the tails a resume abandoned.

The rule lines come from the collector with the series (`StepSeries.rule_lines`), as for
every step chart (`ampwatch.dashboard.step_figures` says why nothing here computes one).

    >>> from ampwatch.dashboard.series_types import StepSeries
    >>> series = StepSeries.from_json({"step": [1, 2], "loss_scale": [65536.0, 32768.0],
    ...                                "skipped": [False, True]})
    >>> loss_scale_figure(series).layout.yaxis.type
    'log'
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ampwatch.dashboard.figure_common import (
    CHECKPOINT_COLOR,
    LOSS_COLOR,
    NON_FINITE_COLOR,
    SCALE_COLOR,
    SEVERITY_COLORS,
    SKIPPED_COLOR,
    STEP_AXIS_TITLE,
    _message,
    _title,
    _x_axis,
    empty_figure,
    figure_of,
    log2_ticks,
    plot_steps,
    plot_values,
    two_rows,
)
from ampwatch.dashboard.run_types import Alert
from ampwatch.dashboard.series_types import AbandonedTail, RuleLines, StepSeries
from ampwatch.dashboard.step_figures import abandoned_traces

#: Verdicts of the restart advisor, as drawn on the loss-scale chart.
RECOMMENDED = "recommended"

REJECTED = "rejected"

NO_SCALER_MESSAGE = (
    "No loss scale reported: this run has no enabled GradScaler. "
    "Under FP16 that lets small gradients flush to zero; check the zero-gradient heatmap."
)

#: (legend name, scale, dash) of one rule line (`scale_lines`).
ScaleLine = tuple[str, float, str]


def scale_lines(lines: RuleLines | None) -> list[ScaleLine]:
    """(legend name, scale, dash) of the loss-scale lines the run's rules judge by:
    loss_scale_collapse's min_scale, and where the run reported its scaler's floor, that
    floor and the headroom line above it (a skip below it collapses at once).

    >>> from ampwatch.dashboard.series_types import RuleLines
    >>> [name for name, _, _ in scale_lines(RuleLines(None, True, 2.0, 10.0, 128, 50, 1.0,
    ...                                                2.0**-4, 4, 1.0))]
    ['min_scale (loss_scale_collapse)', 'scaler floor (run_start)', 'floor x 2^4 (loss_scale_collapse)']
    """
    if lines is None:
        return []
    drawn = [("min_scale (loss_scale_collapse)", lines.min_scale, "dash")]
    if lines.scaler_floor is not None and lines.scaler_floor > 0:
        drawn.append(("scaler floor (run_start)", lines.scaler_floor, "solid"))
    if lines.floor_headroom_scale is not None and lines.floor_headroom_scale > 0:
        name = f"floor x 2^{lines.floor_headroom_octaves} (loss_scale_collapse)"
        drawn.append((name, lines.floor_headroom_scale, "dot"))
    return [line for line in drawn if line[1] > 0]  # a log axis cannot draw 0


def _scale_range(
    shown: np.ndarray, abandoned: Sequence[AbandonedTail], lines: Sequence[ScaleLine]
) -> tuple[float, float]:
    """The scale axis' (low, high): an octave beyond every scale drawn, the abandoned
    tails' and the rule lines' included (how far the scale sits above them is the point)."""
    gone = [plot_values(tail.loss_scale, positive=True) for tail in abandoned]
    gone_shown = [float(v) for array in gone for v in array[~np.isnan(array)]]
    levels = [*shown.tolist(), *gone_shown, *(value for _, value, _ in lines)] or [1.0]
    return min(levels) / 2, max(levels) * 2


def _scale_traces(
    series: StepSeries, steps: np.ndarray, scales: np.ndarray, floor: float
) -> list[dict[str, Any]]:
    """The scale as a step line, and a red x at every skipped step (on the axis `floor`
    where the scale is unknown)."""
    skipped = [i for i, was_skipped in enumerate(series.skipped) if was_skipped]
    return [
        {
            "type": "scatter",
            "x": steps,
            "y": scales,
            "name": "loss scale",
            "mode": "lines",
            "line": {"shape": "hv", "color": SCALE_COLOR},
            "hovertemplate": "%{y:.6g}",
        },
        {
            "type": "scatter",
            "x": [series.step[i] for i in skipped],
            # A skipped step whose scale is unknown still shows, on the axis floor.
            "y": [float(scales[i]) if not math.isnan(scales[i]) else floor for i in skipped],
            # Downsampled, one marker stands for its bucket's skips: the legend counts steps.
            "name": f"skipped step ({sum(series.skipped_count)})",
            "mode": "markers",
            "customdata": [max(series.skipped_count[i], 1) for i in skipped],
            "marker": {"symbol": "x", "size": 9, "color": SKIPPED_COLOR},
            "hovertemplate": "%{customdata} skipped",
        },
    ]


def _loss_trace(steps: np.ndarray, losses: np.ndarray) -> dict[str, Any]:
    return {
        "type": "scatter",
        "x": steps,
        "y": losses,
        "name": "loss",
        "mode": "lines",
        "xaxis": "x2",
        "yaxis": "y2",
        "line": {"color": LOSS_COLOR, "width": 1.5},
        "connectgaps": False,
        "hovertemplate": "%{y:.4g}",
    }


def _rule_line_traces(series: StepSeries, lines: Sequence[ScaleLine]) -> list[dict[str, Any]]:
    """Each rule line, grey, across the series' steps."""
    return [
        {
            "type": "scatter",
            "x": [series.step[0], series.step[-1]],
            "y": [value, value],
            "name": name,
            "mode": "lines",
            "line": {"dash": dash, "color": "#888888", "width": 1},
            "hovertemplate": f"{name}: %{{y:.6g}}<extra></extra>",
        }
        for name, value, dash in lines
    ]


def _non_finite_loss_traces(series: StepSeries, losses: np.ndarray) -> list[dict[str, Any]]:
    """Orange triangles on the top edge of the loss range where the loss was NaN or
    infinite (none when it never was): a gap alone is easy to miss."""
    non_finite = [i for i, v in enumerate(series.loss) if v is not None and not math.isfinite(v)]
    if not non_finite:
        return []
    ceiling = float(np.nanmax(losses)) if not np.isnan(losses).all() else 0.0
    return [
        {
            "type": "scatter",
            "x": [series.step[i] for i in non_finite],
            "y": [ceiling] * len(non_finite),
            "customdata": [str(series.loss[i]) for i in non_finite],
            "name": "non-finite loss",
            "mode": "markers",
            "xaxis": "x2",
            "yaxis": "y2",
            "marker": {"symbol": "triangle-up", "size": 10, "color": NON_FINITE_COLOR},
            "hovertemplate": "loss %{customdata}",
        }
    ]


def _checkpoint_marks(
    checkpoints: Mapping[int, str],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(verticals, labels) at the checkpoints: the recommended restart solid and labelled,
    rejected ones grey and unlabelled, the others dotted 'ckpt'."""
    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    line: dict[str, Any]
    for step, verdict in sorted(checkpoints.items()):
        if verdict == RECOMMENDED:
            line, text, color = {"width": 3}, "restart here", CHECKPOINT_COLOR
        elif verdict == REJECTED:
            line, text, color = {"dash": "dot", "width": 1}, "", "#9ca3af"
        else:
            line, text, color = {"dash": "dot", "width": 1}, "ckpt", CHECKPOINT_COLOR
        shapes.append(
            {
                "type": "line",
                "xref": "x",
                "x0": step,
                "x1": step,
                "yref": "paper",
                "y0": 0,
                "y1": 1,
                "line": {**line, "color": color},
            }
        )
        if text:
            annotations.append(
                {
                    "text": text,
                    "x": step,
                    "xref": "x",
                    "y": 1,
                    "yref": "paper",
                    "yanchor": "bottom",
                    "showarrow": False,
                    "font": {"size": 11 if verdict == RECOMMENDED else 10, "color": color},
                }
            )
    return shapes, annotations


def _alert_spans(alerts: Sequence[Alert], last_step: int) -> list[dict[str, Any]]:
    """A faint band, in its severity's colour, over each run-wide alert's firing span (to
    `last_step` while it still fires)."""
    return [
        {
            "type": "rect",
            "xref": "x",
            "yref": "paper",
            "y0": 0,
            "y1": 1,
            "x0": alert.fired_step,
            "x1": alert.resolved_step if alert.resolved_step is not None else last_step,
            "fillcolor": SEVERITY_COLORS.get(alert.severity, SKIPPED_COLOR),
            "opacity": 0.08,
            "line": {"width": 0},
            "layer": "below",
        }
        for alert in alerts
        if alert.layer is None and alert.fired_step is not None
    ]


def _loss_scale_axes(
    x_range: Sequence[int] | None, low: float, high: float
) -> dict[str, dict[str, Any]]:
    """Two rows on one step axis: the scale (log, ticks at powers of two) over the loss."""
    tick_values, tick_text = log2_ticks(low, high)
    axes = two_rows(0.6)
    axes["xaxis"].update(_x_axis(x_range))
    axes["xaxis2"].update(_x_axis(x_range, title={"text": STEP_AXIS_TITLE}))
    axes["yaxis"].update(
        type="log",
        range=[math.log10(low), math.log10(high)],
        tickvals=tick_values,
        ticktext=tick_text,
        title={"text": "loss scale (log2)"},
    )
    axes["yaxis2"].update(title={"text": "loss"})
    return axes


def loss_scale_figure(
    series: StepSeries,
    *,
    checkpoints: Mapping[int, str] | None = None,
    alerts: Sequence[Alert] = (),
    abandoned: Sequence[AbandonedTail] = (),
    x_range: Sequence[int] | None = None,
) -> go.Figure:
    """Loss scale on a log2 axis over loss, sharing the step axis.

    Top: the scale as a step line, the scale lines the run's rules judge by (`scale_lines`),
    a red x at every skipped step, verticals at checkpoints (`checkpoints`: step → the advisor's
    verdict, '' when there is none): the recommended restart solid and labelled, rejected
    ones grey. Run-wide alerts shade the span they fired over. Bottom: the loss, with gaps
    and orange triangles (on the top edge of the loss range) where it was NaN or infinite.
    `abandoned`: tails a resume abandoned, greyed under both (`abandoned_traces`).
    `x_range`: the zoom window the series was fetched for.
    """
    title = "Loss scale and loss"
    if not series.step:
        return empty_figure(title, "No steps reported for this run yet.")
    steps = plot_steps(series.step)
    scales = plot_values(series.loss_scale, positive=True)
    shown = scales[~np.isnan(scales)]
    lines = scale_lines(series.rule_lines)
    low, high = _scale_range(shown, abandoned, lines)
    losses = plot_values(series.loss)
    data: list[dict[str, Any]] = [
        *abandoned_traces(abandoned, "loss_scale", hv=True),
        *abandoned_traces(abandoned, "loss", xaxis="x2", yaxis="y2"),
        *_scale_traces(series, steps, scales, low),
        _loss_trace(steps, losses),
        *_rule_line_traces(series, lines),
        *_non_finite_loss_traces(series, losses),
    ]
    shapes, annotations = _checkpoint_marks(checkpoints or {})
    shapes += _alert_spans(alerts, series.step[-1])
    if not shown.size:
        # An empty log axis would read as "no data yet"; say what it really means.
        annotations.append(_message(NO_SCALER_MESSAGE, xref="x domain", yref="y domain", size=13))
    return figure_of(
        data,
        {
            "title": _title(title),
            "height": 480,
            "shapes": shapes,
            "annotations": annotations,
            **_loss_scale_axes(x_range, low, high),
        },
    )
