"""The run page's step charts, pure functions from decoded API data to plotly figures:
the loss scale (with skipped steps, checkpoints, alerts), skip rate, gradient norm and
activation norm (with its robust baseline band).

    >>> from ampwatch.dashboard.client import StepSeries
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

from ampwatch.dashboard.client import Alert, StepSeries
from ampwatch.dashboard.figure_common import (
    CHECKPOINT_COLOR,
    HEALTHY_SCALE,
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
from ampwatch.server.baselines import MAD_TO_SIGMA

#: Verdicts of the restart advisor, as drawn on the loss-scale chart.
RECOMMENDED = "recommended"

REJECTED = "rejected"

#: Activation-norm baseline band: trailing median ± BAND_MADS robust deviations
#: (1.4826 · MAD) over the previous BAND_POINTS points of the series.
BAND_POINTS = 256

BAND_MADS = 4.0

NO_SCALER_MESSAGE = (
    "No loss scale reported: this run has no enabled GradScaler. "
    "Under FP16 that lets small gradients flush to zero; check the zero-gradient heatmap."
)


def loss_scale_figure(
    series: StepSeries,
    *,
    checkpoints: Mapping[int, str] | None = None,
    alerts: Sequence[Alert] = (),
    x_range: Sequence[int] | None = None,
) -> go.Figure:
    """Loss scale on a log2 axis over loss, sharing the step axis.

    Top: the scale as a step line, a dashed line at 1.0 (the healthy floor), a red x at
    every skipped step, verticals at checkpoints (`checkpoints`: step → the advisor's
    verdict, '' when there is none): the recommended restart solid and labelled, rejected
    ones grey. Run-wide alerts shade the span they fired over. Bottom: the loss, with gaps
    and orange triangles (on the top edge of the loss range) where it was NaN or infinite.
    `x_range`: the zoom window the series was fetched for.
    """
    title = "Loss scale and loss"
    if not series.step:
        return empty_figure(title, "No steps reported for this run yet.")
    steps = plot_steps(series.step)
    scales = plot_values(series.loss_scale, positive=True)
    shown = scales[~np.isnan(scales)]
    # 1.0 is always in range: how far the scale sits above it is the point of the chart.
    low = min(float(shown.min()) if shown.size else HEALTHY_SCALE, HEALTHY_SCALE) / 2
    high = max(float(shown.max()) if shown.size else HEALTHY_SCALE, HEALTHY_SCALE) * 2
    tick_values, tick_text = log2_ticks(low, high)
    skipped = [i for i, was_skipped in enumerate(series.skipped) if was_skipped]
    losses = plot_values(series.loss)
    data: list[dict[str, Any]] = [
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
            "y": [float(scales[i]) if not math.isnan(scales[i]) else low for i in skipped],
            # Downsampled, one marker stands for its bucket's skips: the legend counts steps.
            "name": f"skipped step ({sum(series.skipped_count)})",
            "mode": "markers",
            "customdata": [max(series.skipped_count[i], 1) for i in skipped],
            "marker": {"symbol": "x", "size": 9, "color": SKIPPED_COLOR},
            "hovertemplate": "%{customdata} skipped",
        },
        {
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
        },
    ]
    non_finite = [i for i, v in enumerate(series.loss) if v is not None and not math.isfinite(v)]
    if non_finite:
        ceiling = float(np.nanmax(losses)) if not np.isnan(losses).all() else 0.0
        data.append(
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
        )
    shapes: list[dict[str, Any]] = [
        {
            "type": "line",
            "xref": "x domain",
            "x0": 0,
            "x1": 1,
            "yref": "y",
            "y0": HEALTHY_SCALE,
            "y1": HEALTHY_SCALE,
            "line": {"dash": "dash", "color": "#888888", "width": 1},
        }
    ]
    annotations: list[dict[str, Any]] = []
    line: dict[str, Any]
    for step, verdict in sorted((checkpoints or {}).items()):
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
    shapes.extend(
        {
            "type": "rect",
            "xref": "x",
            "yref": "paper",
            "y0": 0,
            "y1": 1,
            "x0": alert.fired_step,
            "x1": alert.resolved_step if alert.resolved_step is not None else series.step[-1],
            "fillcolor": SEVERITY_COLORS.get(alert.severity, SKIPPED_COLOR),
            "opacity": 0.08,
            "line": {"width": 0},
            "layer": "below",
        }
        for alert in alerts
        if alert.layer is None and alert.fired_step is not None
    )
    if not shown.size:
        # An empty log axis would read as "no data yet"; say what it really means.
        annotations.append(_message(NO_SCALER_MESSAGE, xref="x domain", yref="y domain", size=13))
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
    return figure_of(
        data,
        {
            "title": _title(title),
            "height": 480,
            "shapes": shapes,
            "annotations": annotations,
            **axes,
        },
    )


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


def grad_norm_figure(series: StepSeries, *, x_range: Sequence[int] | None = None) -> go.Figure:
    """Global gradient norm (unscaled), log axis; non-finite norms are gaps. Where the loop
    clipped, the norm before the clip is the main line and the one after it a second."""
    title = "Gradient norm"
    norms = plot_values(series.grad_norm, positive=True)
    if np.isnan(norms).all():
        return empty_figure(title, "No gradient norm reported for this run yet.")
    steps = plot_steps(series.step)
    traces = [
        {
            "type": "scatter",
            "x": steps,
            "y": norms,
            "name": "grad norm (unscaled, before clipping)",
            "mode": "lines",
            "line": {"color": "#2ca02c", "width": 1.5},
            "hovertemplate": "%{y:.4g}",
        }
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


def _trailing_baselines(kept: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position j of the finite `kept`, over its last `window` values (kept[j] included):
    the median, the spread as a standard deviation (`MAD_TO_SIGMA` x MAD) and the minimum,
    as `ampwatch.server.baselines.robust_baseline(..., skip_nan=True)` and `np.nanmin`
    give them.

    Why not those: the windows of the first positions are padded with NaN, which sends
    numpy's medians through masked arrays, 88 ms of the run page's ~150 ms of figures at
    2,000 points. Sorted, each window's finite values come first (NaN sorts last), so a
    median is the mean of two known places of the row.
    """
    padded = np.concatenate([np.full(window - 1, np.nan), kept])
    windows = np.lib.stride_tricks.sliding_window_view(padded, window)  # windows[j]: ..kept[j]
    rows = np.arange(len(kept))
    counts = np.minimum(rows + 1, window)

    def medians(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ordered = np.sort(values, axis=1)
        middle = (ordered[rows, (counts - 1) // 2] + ordered[rows, counts // 2]) / 2
        return middle, ordered[:, 0]

    centers, floors = medians(windows)
    deviations, _ = medians(np.abs(windows - centers[:, None]))
    return centers, MAD_TO_SIGMA * deviations, floors


def baseline_band(
    values: Sequence[float | None] | np.ndarray, window: int = BAND_POINTS
) -> tuple[np.ndarray, np.ndarray]:
    """A robust trailing baseline: median ± `BAND_MADS` · 1.4826 · MAD of the previous
    `window` finite values (NaN until 8 are seen). A spike sits above it, not inside it.

    >>> low, high = baseline_band([1.0] * 10 + [50.0])
    >>> float(low[-1]), float(high[-1]), bool(np.isnan(low[0]))
    (1.0, 1.0, True)
    """
    finite = plot_values(list(values))
    seen = np.flatnonzero(~np.isnan(finite))  # positions of the finite values, in order
    kept = finite[seen]
    # The band at position i uses the finite values before i: the last `window` of them.
    before = np.searchsorted(seen, np.arange(len(finite)), side="left")
    low = np.full(len(finite), np.nan)
    high = np.full(len(finite), np.nan)
    if len(kept) < 8:
        return low, high
    medians, sigmas, floors = _trailing_baselines(kept, window)
    spreads = BAND_MADS * sigmas
    ready = before >= 8
    at = before[ready] - 1
    # The band never reaches below the window's smallest value: a wide spread would
    # otherwise put its floor at 0, which a log axis cannot draw (the fill would flood).
    low[ready] = np.maximum(medians[at] - spreads[at], floors[at])
    high[ready] = medians[at] + spreads[at]
    return low, high


def activation_norm_figure(
    series: StepSeries, *, x_range: Sequence[int] | None = None
) -> go.Figure:
    """Final-layer activation L2 norm, max and mean over tokens (the OPT-175B precursor),
    with the max's trailing robust baseline as a shaded band (`baseline_band`), and, where
    the agent measured it, the mean before the final norm (which caps the norm after it)."""
    title = "Final-layer activation norm"
    means = plot_values(series.act_norm_mean)
    maxima = plot_values(series.act_norm_max)
    if np.isnan(means).all() and np.isnan(maxima).all():
        return empty_figure(title, "No final-layer activation norm reported for this run yet.")
    steps = plot_steps(series.step)
    low, high = baseline_band(maxima)
    data: list[dict[str, Any]] = [
        {
            "type": "scatter",
            "x": steps,
            "y": low,
            "mode": "lines",
            "line": {"width": 0},
            "showlegend": False,
            "hoverinfo": "skip",
            "name": "baseline low",
        },
        {
            "type": "scatter",
            "x": steps,
            "y": high,
            "mode": "lines",
            "line": {"width": 0},
            "fill": "tonexty",
            "fillcolor": "rgba(148, 103, 189, 0.15)",
            "name": "baseline band (max)",
            "hoverinfo": "skip",
        },
        {
            "type": "scatter",
            "x": steps,
            "y": maxima,
            "name": "max over tokens",
            "mode": "lines",
            "line": {"color": "#9467bd"},
            "hovertemplate": "%{y:.4g}",
        },
        {
            "type": "scatter",
            "x": steps,
            "y": means,
            "name": "mean over tokens",
            "mode": "lines",
            "line": {"color": SCALE_COLOR},
            "hovertemplate": "%{y:.4g}",
        },
    ]
    prenorm = plot_values(series.act_prenorm_mean)
    if not np.isnan(prenorm).all():
        data.append({"type": "scatter", "x": steps, "y": prenorm,
                     "name": "mean before the final norm", "mode": "lines",
                     "line": {"color": SCALE_COLOR, "dash": "dot"},
                     "hovertemplate": "%{y:.4g}"})  # fmt: skip
    y_axis: dict[str, Any] = {"title": {"text": "activation L2 norm"}}
    if not (np.nan_to_num(np.concatenate([means, maxima, prenorm]), nan=1.0) <= 0).any():
        y_axis["type"] = "log"  # a 50x spike must not flatten the baseline it is judged by
    return _step_figure(title, data, height=320, x_range=x_range, y_axis=y_axis)
