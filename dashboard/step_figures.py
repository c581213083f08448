"""The run page's step charts, pure functions from decoded API data to plotly figures:
skip rate, gradient norm and activation norm (with activation_norm_spike's own firing
threshold), and the tails a resume abandoned, greyed under the live branch. The loss-scale
chart, with the scale lines its rules judge by, is `ampwatch.dashboard.loss_scale_figures`.

The rule lines come from the collector with the series (`StepSeries.rule_lines`,
`act_threshold`): the run's effective settings and the threshold the rule engine judged
each step against. Nothing here computes a baseline of its own, so a point drawn above a
line is a step the rule judged above it (`ampwatch.server.series`: the downsampled line is
exact both ways against a bucket's maximum).

    >>> from ampwatch.dashboard.series_types import StepSeries
    >>> series = StepSeries.from_json({"step": [1, 2], "grad_norm": [0.5, 4.0]})
    >>> grad_norm_figure(series).layout.yaxis.type
    'log'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ampwatch.dashboard.figure_common import (
    ABANDONED_COLOR,
    SCALE_COLOR,
    SKIPPED_COLOR,
    STEP_AXIS_TITLE,
    _title,
    _x_axis,
    empty_figure,
    figure_of,
    plot_steps,
    plot_values,
)
from ampwatch.dashboard.series_types import AbandonedTail, StepSeries

#: The trace of activation_norm_spike's threshold (the browser test finds it by name).
THRESHOLD_TRACE = "alert threshold (activation_norm_spike)"

#: The activation-norm traces by step field: (legend name, colour, dash).
ACT_TRACES = {
    "act_norm_max": ("max over tokens", "#9467bd", None),
    "act_norm_mean": ("mean over tokens", SCALE_COLOR, None),
    "act_prenorm_mean": ("mean before the final norm", SCALE_COLOR, "dot"),
    "act_prenorm_max": ("max before the final norm", "#9467bd", "dot"),
}

#: The legend name of a resume's abandoned tail (the browser test finds it by prefix).
ABANDONED_TRACE = "abandoned after step {from_step}"


def abandoned_traces(
    tails: Sequence[AbandonedTail], field: str, *, hv: bool = False, **axes: str
) -> list[dict[str, Any]]:
    """`field` of each abandoned tail as a grey line, one legend entry per resume, to draw
    under the live branch (listed first): where the run went before it was rolled back.
    `axes`: the subplot's (`xaxis="x2", yaxis="y2"`); `hv`: a step line (the loss scale)."""
    positive = field != "loss"
    return [
        {
            "type": "scatter",
            "x": plot_steps(tail.step),
            "y": plot_values(getattr(tail, field), positive=positive),
            "name": ABANDONED_TRACE.format(from_step=tail.from_step),
            "legendgroup": f"abandoned-{tail.branch}",
            "showlegend": field != "loss",
            "mode": "lines",
            "line": {"color": ABANDONED_COLOR, "width": 1.5, **({"shape": "hv"} if hv else {})},
            "opacity": 0.8,
            "connectgaps": False,
            "hovertemplate": "abandoned: %{y:.4g}<extra></extra>",
            **axes,
        }
        for tail in tails
        if tail.step
    ]


def _step_figure(
    title: str,
    data: Sequence[dict[str, Any]],
    *,
    y_axis: dict[str, Any],
    height: int = 300,
    x_range: Sequence[int] | None = None,
    subtitle: str | None = None,
    **layout: Any,
) -> go.Figure:
    """The common frame of the single-axis step charts below."""
    return figure_of(
        data,
        {
            "title": _title(title, subtitle),
            "height": height,
            "xaxis": _x_axis(x_range, title={"text": STEP_AXIS_TITLE}),
            "yaxis": y_axis,
            **layout,
        },
    )


def skip_rates(series: StepSeries, buckets: int = 100) -> tuple[list[int], list[float]]:
    """Share of skipped steps per window of steps, about `buckets` windows over the series.

    Windows are aligned multiples of a width no finer than the series' own buckets; a
    window's rate is its skipped steps over the steps it spans within the series.

    >>> skip_rates(StepSeries.from_json({"step": [1, 2, 3, 4], "skipped": [0, 1, 1, 0]}), 2)
    ([0, 2, 4], [0.0, 1.0, 0.0])
    """
    if not series.step:
        return [], []
    first, last = series.step[0], series.step[-1]
    width = max(series.bucket_width, math.ceil((last - first + 1) / buckets))
    skipped: dict[int, int] = {}
    for step, count in zip(series.step, series.skipped_count, strict=False):
        key = step // width * width
        skipped[key] = skipped.get(key, 0) + count
    starts = sorted(skipped)
    rates = [
        skipped[start] / (min(start + width - 1, last) - max(start, first) + 1) for start in starts
    ]
    return starts, rates


def skip_rate_figure(series: StepSeries, *, x_range: Sequence[int] | None = None) -> go.Figure:
    """Share of optimizer steps skipped (Inf/NaN gradients) per window: a storm shows as bars."""
    title = "Skip rate"
    if not series.step:
        return empty_figure(title, "No steps reported for this run yet.")
    starts, rates = skip_rates(series)
    width = starts[1] - starts[0] if len(starts) > 1 else 1
    bars = {
        "type": "bar",
        "x": [start + width / 2 for start in starts],
        "y": rates,
        "width": width,
        "name": "skipped share",
        "marker": {"color": SKIPPED_COLOR},
        "customdata": starts,
        "hovertemplate": f"steps %{{customdata}}+{width}<br>%{{y:.1%}} skipped<extra></extra>",
    }
    return _step_figure(
        title,
        [bars],
        height=240,
        x_range=x_range,
        subtitle=f"share of steps skipped per {width:,}-step window",
        y_axis={"title": {"text": "skipped steps"}, "tickformat": ".0%", "rangemode": "tozero"},
        bargap=0,
        showlegend=False,
    )


def grad_norm_figure(
    series: StepSeries,
    *,
    abandoned: Sequence[AbandonedTail] = (),
    x_range: Sequence[int] | None = None,
) -> go.Figure:
    """Global gradient norm (unscaled), log axis; non-finite norms are gaps. Where the loop
    clipped, the norm before the clip is the main line and the one after it a second.
    `abandoned`: tails a resume abandoned, greyed under it."""
    title = "Gradient norm"
    norms = plot_values(series.grad_norm, positive=True)
    if np.isnan(norms).all():
        return empty_figure(title, "No gradient norm reported for this run yet.")
    steps = plot_steps(series.step)
    traces = [
        *abandoned_traces(abandoned, "grad_norm"),
        {
            "type": "scatter",
            "x": steps,
            "y": norms,
            "name": "grad norm (unscaled, before clipping)",
            "mode": "lines",
            "line": {"color": "#2ca02c", "width": 1.5},
            "hovertemplate": "%{y:.4g}",
        },
    ]
    clipped = plot_values(series.grad_norm_clipped, positive=True)
    if not np.isnan(clipped).all():
        traces.append(
            {
                "type": "scatter",
                "x": steps,
                "y": clipped,
                "name": "after clipping",
                "mode": "lines",
                "line": {"color": "#98df8a", "width": 1, "dash": "dot"},
                "hovertemplate": "%{y:.4g}",
            }
        )
    return _step_figure(
        title,
        traces,
        height=260,
        x_range=x_range,
        y_axis={"title": {"text": "global L2 norm"}, "type": "log"},
    )


def activation_norm_figure(
    series: StepSeries, *, x_range: Sequence[int] | None = None
) -> go.Figure:
    """Final-layer activation L2 norm, max and mean over tokens (the OPT-175B precursor),
    and, where the agent measured it, the mean before the final norm (which caps the norm
    after it); over the field activation_norm_spike judges, its own firing threshold per
    step as the collector judged it (`THRESHOLD_TRACE`; its hover names the rule's other
    conditions: not judged in warm-up calibration nor before min_baseline_steps)."""
    title = "Final-layer activation norm"
    means = plot_values(series.act_norm_mean)
    maxima = plot_values(series.act_norm_max)
    if np.isnan(means).all() and np.isnan(maxima).all():
        return empty_figure(title, "No final-layer activation norm reported for this run yet.")
    steps = plot_steps(series.step)
    lines = series.rule_lines
    judged = lines.act_field if lines is not None else None
    data: list[dict[str, Any]] = []
    drawn: list[np.ndarray] = []
    for field, (name, color, dash) in ACT_TRACES.items():
        values = plot_values(getattr(series, field))
        optional = field.startswith("act_prenorm") and field != judged
        if optional and (field == "act_prenorm_max" or np.isnan(values).all()):
            continue  # the pre-norm max is drawn only when it is what the rule judges
        drawn.append(values)
        data.append({"type": "scatter", "x": steps, "y": values,
                     "name": name, "mode": "lines",
                     "line": {"color": color, "dash": dash},
                     "hovertemplate": "%{y:.4g}"})  # fmt: skip
    thresholds = plot_values(series.act_threshold, positive=True)
    if lines is not None and judged is not None and not np.isnan(thresholds).all():
        judged_name = ACT_TRACES[judged][0]
        conditions = (
            f"fires on the {judged_name} at >= {lines.min_ratio:g}x the median of the last "
            f"{lines.baseline_steps} steps and a robust z > {lines.z_threshold:g}; "
            f"not judged during warm-up calibration nor before {lines.min_baseline_steps} "
            "steps of baseline"
        )
        data.append(
            {
                "type": "scatter",
                "x": steps,
                "y": thresholds,
                "name": THRESHOLD_TRACE,
                "mode": "lines",
                "line": {"color": SKIPPED_COLOR, "dash": "dash", "width": 1, "shape": "hv"},
                "connectgaps": False,
                "customdata": series.act_above_count,
                "hovertemplate": "threshold %{y:.4g} (%{customdata} steps above)<br>"
                + conditions
                + "<extra></extra>",
            }
        )
        drawn.append(thresholds)
    y_axis: dict[str, Any] = {"title": {"text": "activation L2 norm"}}
    if not (np.nan_to_num(np.concatenate(drawn), nan=1.0) <= 0).any():
        y_axis["type"] = "log"  # a 50x spike must not flatten the baseline it is judged by
    return _step_figure(title, data, height=320, x_range=x_range, y_axis=y_axis)
