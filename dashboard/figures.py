"""Pure functions from decoded API data to plotly figures; no Dash, no I/O.

Non-finite values are data here, not errors: a NaN or infinite point is drawn as a gap in
its line (plotly breaks a line at None), and a non-finite loss is also marked, because a
gap alone is easy to miss and a NaN loss is divergence, not a scaling hiccup.

    >>> from ampwatch.dashboard.client import StepSeries
    >>> series = StepSeries.from_json({"step": [1, 2], "loss_scale": [65536.0, 32768.0],
    ...                                "skipped": [False, True]})
    >>> loss_scale_figure(series).layout.yaxis.type
    'log'
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import numpy.typing as npt
import plotly.graph_objects as go

from ampwatch.dashboard.client import Alert, LayerMatrix, StepSeries

STEP_AXIS_TITLE = "optimizer step"
HEALTHY_SCALE = 1.0  # OPT-175B restarted from checkpoints whose scale was still >= 1.0
SKIPPED_COLOR = "#d62728"
NON_FINITE_COLOR = "#ff7f0e"
SCALE_COLOR = "#1f77b4"
LOSS_COLOR = "#444444"
CHECKPOINT_COLOR = "#2ca02c"
FROZEN_COLOR = "#d62728"
MAX_LOG2_TICKS = 10
UI_REVISION = "keep"
SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
#: Verdicts of the restart advisor, as drawn on the loss-scale chart.
RECOMMENDED = "recommended"
REJECTED = "rejected"
#: Activation-norm baseline band: trailing median ± BAND_MADS robust deviations
#: (1.4826 · MAD) over the previous BAND_POINTS points of the series.
BAND_POINTS = 256
BAND_MADS = 4.0
#: A distinct colour per run on the compare page (colour-blind-safe Okabe-Ito order).
RUN_COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")

# Zero-gradient fraction: pale to dark blue as a layer's share of exact zeros grows, and a
# jump to red only at exactly 1.0, so a frozen layer stands out from a merely sparse one.
ZERO_FRACTION_COLORSCALE: list[list[float | str]] = [
    [0.0, "#f7fbff"],
    [0.5, "#6baed6"],
    [0.999, "#08306b"],
    [1.0, FROZEN_COLOR],
]

# No automargin: it makes plotly.js lay every chart out twice (measure the labels, grow the
# margin, draw again), 10-200 ms a chart. Step charts' tick labels fit the fixed margins;
# charts labelled with names size their margin from the names (`label_margin`). Labels
# may overflow the plot ("allow"), so plotly.js does not measure each against it.
_GRID = {
    "gridcolor": "#EBF0F8",
    "zerolinecolor": "#EBF0F8",
    "linecolor": "#EBF0F8",
    "automargin": False,
    "ticklabeloverflow": "allow",
}
#: plotly_white's look in a few keys: the full template is ~9 KB in every figure's JSON
#: and a deep copy in every figure built (a fifth of the run page's render time).
TEMPLATE = {
    "layout": {
        "paper_bgcolor": "white",
        "plot_bgcolor": "white",
        "font": {"color": "#2a3f5f"},
        "title": {"x": 0.05},
        "xaxis": _GRID,
        "yaxis": _GRID,
        "colorway": ["#636efa", "#EF553B", "#00cc96", "#ab63fa", "#FFA15A", "#19d3f3"],
        "hoverlabel": {"align": "left"},
    }
}

# The legend sits between the title and the plot; the top margin leaves room for both.
MARGIN = {"l": 70, "r": 30, "t": 90, "b": 50}
_BASE_LAYOUT = {
    "template": TEMPLATE,
    "margin": MARGIN,
    "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
    "hovermode": "x unified",
    # The page rebuilds figures every refresh; a constant uirevision keeps the user's zoom,
    # pan and hidden traces across those rebuilds instead of resetting them every 5 s.
    "uirevision": UI_REVISION,
}


NO_SCALER_MESSAGE = (
    "No loss scale reported: this run has no enabled GradScaler. "
    "Under FP16 that lets small gradients flush to zero; check the zero-gradient heatmap."
)


def plot_values(values: Sequence[float | None], *, positive: bool = False) -> np.ndarray:
    """A float64 array for a plotly trace: None (not measured) and non-finite values (and,
    with `positive`, values <= 0, which a log axis cannot show) become NaN, which plotly.js
    draws as a gap. Numpy arrays also travel as base64 typed arrays, ~40% of JSON numbers'
    size, and skip plotly.py's element-by-element validation of lists.

    >>> plot_values([1.0, None, float("inf"), 0.0], positive=True).tolist()
    [1.0, nan, nan, nan]
    """
    array = np.array([math.nan if v is None else v for v in values], dtype=np.float64)
    bad = ~np.isfinite(array)
    if positive:
        bad |= array <= 0
    array[bad] = math.nan
    return array


def plot_steps(steps: Sequence[int]) -> np.ndarray:
    return np.asarray(steps, dtype=np.int64)


def finite_or_none(value: float | None) -> float | None:
    """A plotly-ready value: non-finite becomes None, i.e. a gap in the line."""
    return value if value is not None and math.isfinite(value) else None


def format_loss_scale(value: float | None) -> str:
    """A loss scale as people read it: powers of two (all a dynamic scaler produces) as 2^k.

    >>> format_loss_scale(65536.0), format_loss_scale(0.25), format_loss_scale(None)
    ('65536 (2^16)', '0.25 (2^-2)', '—')
    """
    if value is None:
        return "—"
    if not math.isfinite(value) or value <= 0:
        return str(value)
    exponent = math.log2(value)
    if exponent.is_integer():
        return f"{value:.10g} (2^{int(exponent)})"
    return f"{value:.4g}"


def format_time(iso_time: str) -> str:
    """An API timestamp in UTC to the second, or as given when it does not parse."""
    try:
        moment = datetime.fromisoformat(iso_time)
    except ValueError:
        return iso_time
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def figure_of(
    data: Sequence[Any], layout: dict[str, Any], frames: Sequence[dict[str, Any]] | None = None
) -> go.Figure:
    """A figure built in one call from trace, layout (over `_BASE_LAYOUT`) and animation
    frame dicts.

    One call validates once: plotly.py's update_layout/update_yaxes/add_vline re-validate
    the figure each time (10-30 ms a call), which had made building the run page's figures
    most of its render time.
    """
    return go.Figure(data=list(data), layout={**_BASE_LAYOUT, **layout}, frames=frames)


def _x_axis(x_range: Sequence[int] | None, **extra: Any) -> dict[str, Any]:
    """A step axis, pinned to the zoom window the data was fetched for (None: autorange)."""
    axis: dict[str, Any] = {**extra}
    if x_range is not None:
        axis.update(range=list(x_range), autorange=False)
    return axis


def _title(text: str, subtitle: str | None = None) -> dict[str, Any]:
    return {"text": text, **({"subtitle": {"text": subtitle}} if subtitle else {})}


def _message(
    text: str, *, xref: str = "paper", yref: str = "paper", size: int = 14
) -> dict[str, Any]:
    return {
        "text": text,
        "xref": xref,
        "yref": yref,
        "x": 0.5,
        "y": 0.5,
        "showarrow": False,
        "font": {"size": size, "color": "#666666"},
    }


def empty_figure(title: str, message: str) -> go.Figure:
    """A figure that says why there is nothing to draw, instead of empty axes."""
    return go.Figure(
        layout={
            "title": {"text": title},
            "template": TEMPLATE,
            "height": 300,
            "xaxis": {"visible": False},
            "yaxis": {"visible": False},
            "annotations": [_message(message)],
        }
    )


def two_rows(top_share: float, *, gap: float = 0.06) -> dict[str, Any]:
    """Layout axes of two rows sharing one step axis (row 1: x/y, row 2: x2/y2), as
    make_subplots(rows=2, shared_xaxes=True) would make them, without its cost."""
    split = (1 - gap) * (1 - top_share)
    return {
        "xaxis": {"anchor": "y", "matches": "x2", "showticklabels": False},
        "yaxis": {"anchor": "x", "domain": [split + gap, 1.0]},
        "xaxis2": {"anchor": "y2"},
        "yaxis2": {"anchor": "x2", "domain": [0.0, split]},
    }


def log2_ticks(low: float, high: float) -> tuple[list[float], list[str]]:
    """Tick values and `2^k` labels within [low, high] (both > 0), at most `MAX_LOG2_TICKS`.

    >>> log2_ticks(0.5, 4.0)
    ([0.5, 1.0, 2.0, 4.0], ['2<sup>-1</sup>', '2<sup>0</sup>', '2<sup>1</sup>', '2<sup>2</sup>'])
    """
    k_low, k_high = math.floor(math.log2(low)), math.ceil(math.log2(high))
    stride = max(1, math.ceil((k_high - k_low + 1) / MAX_LOG2_TICKS))
    exponents = range(-(-k_low // stride) * stride, k_high + 1, stride)
    return [2.0**k for k in exponents], [f"2<sup>{k}</sup>" for k in exponents]


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
    padded = np.concatenate([np.full(window - 1, np.nan), kept])
    windows = np.lib.stride_tricks.sliding_window_view(padded, window)  # windows[j]: ..kept[j]
    medians = np.nanmedian(windows, axis=1)
    spreads = BAND_MADS * 1.4826 * np.nanmedian(np.abs(windows - medians[:, None]), axis=1)
    # The band never reaches below the window's smallest value: a wide spread would
    # otherwise put its floor at 0, which a log axis cannot draw (the fill would flood).
    floors = np.nanmin(windows, axis=1)
    ready = before >= 8
    at = before[ready] - 1
    low[ready] = np.maximum(medians[at] - spreads[at], floors[at])
    high[ready] = medians[at] + spreads[at]
    return low, high


def activation_norm_figure(
    series: StepSeries, *, x_range: Sequence[int] | None = None
) -> go.Figure:
    """Final-layer activation L2 norm, max and mean over tokens (the OPT-175B precursor),
    with the max's trailing robust baseline as a shaded band (`baseline_band`)."""
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
    y_axis: dict[str, Any] = {"title": {"text": "activation L2 norm"}}
    if not (np.nan_to_num(np.concatenate([means, maxima]), nan=1.0) <= 0).any():
        y_axis["type"] = "log"  # a 50x spike must not flatten the baseline it is judged by
    return _step_figure(title, data, height=320, x_range=x_range, y_axis=y_axis)


#: What each per-layer statistic of the heatmap is called, and its colour bar's title.
HEATMAP_STATS = {
    "zero_fraction": ("Zero-gradient fraction per layer", "zero-gradient<br>fraction"),
    "subnormal_fraction": ("FP16-subnormal share per layer", "share in FP16<br>subnormal range"),
    "flush_fraction": ("Flush-to-zero forecast per layer", "share that would<br>flush in FP16"),
}
HEATMAP_SUBTITLES = {
    "zero_fraction": f"<span style='color:{FROZEN_COLOR}'>red</span>: frozen layer, "
    "every gradient element exactly zero · click a row for the layer",
    "subnormal_fraction": "share of |g·S| in [2<sup>-24</sup>, 2<sup>-14</sup>): "
    "precision already lost · click a row for the layer",
    "flush_fraction": "share of 0 < |g·S| < 2<sup>-24</sup>: would round to zero in FP16 "
    f"at the scale in effect (<span style='color:{FROZEN_COLOR}'>red</span>: all of it)"
    " · click a row for the layer",
}


def layer_heatmap(matrix: LayerMatrix, *, x_range: Sequence[int] | None = None) -> go.Figure:
    """Layers × steps heatmap of one per-layer gradient statistic (`HEATMAP_STATS`).

    Rows follow the collector's layer order (model order), first layer on top; a cell at
    1.0 (zero fraction: every gradient element zero, the layer is not learning) is red.
    """
    title, colorbar = HEATMAP_STATS.get(matrix.stat, (matrix.stat, matrix.stat))
    if not matrix.layers or not matrix.steps:
        return empty_figure(
            title, "No per-layer gradient statistics yet (the agent samples them every N steps)."
        )
    # float32 is plenty for a colour and a 3-decimal hover, and travels as a typed array
    # at half float64's size; missing cells (and NaN statistics) are NaN, an empty cell.
    z = np.full((len(matrix.layers), len(matrix.steps)), np.nan, dtype=np.float32)
    for i, row in enumerate(matrix.values[: len(matrix.steps)]):
        z[: len(row), i] = plot_values(row[: len(matrix.layers)])
    steps, z = bucket_grid(matrix.steps, z, matrix.step_width)
    heatmap = {
        "type": "heatmap",
        "x": steps,
        "y": matrix.layers,
        "z": z,
        "zmin": 0.0,
        "zmax": 1.0,
        "colorscale": ZERO_FRACTION_COLORSCALE,
        "colorbar": {"title": {"text": colorbar}},
        "hovertemplate": "%{y}<br>"
        + (
            "step %{x}"
            if matrix.step_width <= 1
            else f"{matrix.step_width:,} steps from %{{x}} (their maximum)"
        )
        + "<br>"
        + colorbar.replace("<br>", " ")
        + " %{z:.3f}<extra></extra>",
    }
    return figure_of(
        [heatmap],
        {
            "title": _title(title, HEATMAP_SUBTITLES.get(matrix.stat, "")),
            # Rows stay readable to ~100 layers; beyond, the page would be a scroll of labels.
            "height": min(max(320, 160 + 22 * len(matrix.layers)), 1400),
            "hovermode": "closest",
            "xaxis": _x_axis(x_range, title={"text": STEP_AXIS_TITLE}),
            "yaxis": {"autorange": "reversed", **row_ticks(matrix.layers)},
            "margin": {**MARGIN, "l": label_margin(matrix.layers)},
        },
    )


#: A heatmap goes on its bucket grid only when that has at most this many columns per row
#: it holds; beyond, it keeps its rows' own steps.
GRID_MOST = 4


def bucket_grid(
    steps: Sequence[int], z: npt.NDArray[np.float32], width: int
) -> tuple[list[int], npt.NDArray[np.float32]]:
    """Downsampled columns (`width` > 1) on their buckets' evenly spaced starts: a bucket
    without rows gets an empty column, rows sharing a bucket (a live tail appended at
    finer width) their maximum, as the collector merges them.

    Why: plotly.js paints a heatmap whose x and y are evenly spaced as one pixel per cell,
    scaled by the browser; otherwise it fills every cell on a full-size canvas and encodes
    that as a PNG, which made the heatmap the costliest chart of the run page. A bucket's
    first row rarely sits at its start (the run's first sampled step, say), so the
    collector's step labels alone are uneven.

    >>> cols, grid = bucket_grid([10, 500, 1500, 1510], np.array([[0.1, 0.2, 0.3, 0.4]]), 500)
    >>> cols, grid.tolist()
    ([0, 500, 1000, 1500], [[0.1, 0.2, nan, 0.4]])
    """
    if width <= 1 or not steps:
        return list(steps), z
    keys = np.asarray(steps, dtype=np.int64) // width
    first, last = int(keys[0]), int(keys[-1])
    if last - first >= GRID_MOST * len(steps):
        return list(steps), z  # mostly empty on that grid (a run resumed far ahead)
    grid = np.full((z.shape[0], last - first + 1), np.nan, dtype=z.dtype)
    np.fmax.at(grid.T, keys - first, z.T)
    return (np.arange(first, last + 1) * width).tolist(), grid


#: Most layer names written on the heatmap's axis; every row still names itself on hover.
HEATMAP_ROW_LABELS = 50


#: Row labels are cut (from the left: a layer's name ends in what tells it apart) to this
#: many characters, and the left margin is sized to the longest label within it.
LABEL_CHARS = 48
#: Pixels a character of plotly's default 12 px font takes, rounded up.
CHAR_PX = 7


def short_label(label: str, most: int = LABEL_CHARS) -> str:
    """`label` cut from the left to `most` characters.

    >>> short_label("model.decoder.layers.23.self_attn.out_proj.weight", 24)
    '…lf_attn.out_proj.weight'
    """
    return label if len(label) <= most else "…" + label[len(label) - most + 1 :]


def label_margin(labels: Sequence[str]) -> int:
    """A left margin (px) that fits the longest row label, as cut by `short_label`.

    >>> label_margin(["fc1.weight", "fc2.weight"])
    90
    """
    longest = max((len(short_label(label)) for label in labels), default=0)
    return max(MARGIN["l"], 20 + CHAR_PX * longest)


def row_ticks(rows: Sequence[str], most: int = HEATMAP_ROW_LABELS) -> dict[str, Any]:
    """Tick settings labelling at most `most` evenly spaced rows, each cut by
    `short_label`: plotly.js measures every label it lays out, which made a 200-row heatmap
    the slowest chart of the run page's first render. Hover still names every row in full.

    >>> row_ticks(["a", "b", "c"], most=2)
    {'tickmode': 'array', 'tickvals': ['a', 'c'], 'ticktext': ['a', 'c']}
    """
    shown = list(rows[:: max(1, -(-len(rows) // most))])
    return {"tickmode": "array", "tickvals": shown, "ticktext": [short_label(r) for r in shown]}


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


def compare_figure(runs: Sequence[tuple[str, StepSeries]]) -> go.Figure:
    """Several runs on one step axis: loss, loss scale (log2, with the 1.0 line) and the
    final-layer activation norm (max over tokens, log), one colour per run."""
    title = "Compare runs"
    if not runs:
        return empty_figure(title, "Pick two or more runs to compare.")
    data: list[dict[str, Any]] = []
    scales: list[float] = []
    for i, (name, series) in enumerate(runs):
        color = RUN_COLORS[i % len(RUN_COLORS)]
        scale = plot_values(series.loss_scale, positive=True)
        scales += scale[~np.isnan(scale)].tolist()
        steps = plot_steps(series.step)
        for row, values, shape in (
            (1, plot_values(series.loss), "linear"),
            (2, scale, "hv"),
            (3, plot_values(series.act_norm_max, positive=True), "linear"),
        ):
            data.append(
                {
                    "type": "scatter",
                    "x": steps,
                    "y": values,
                    "name": name,
                    "legendgroup": name,
                    "showlegend": row == 1,
                    "mode": "lines",
                    "xaxis": f"x{row}" if row > 1 else "x",
                    "yaxis": f"y{row}" if row > 1 else "y",
                    "line": {"color": color, "shape": shape, "width": 1.5},
                    "hovertemplate": f"{name}: %{{y:.4g}}<extra></extra>",
                }
            )
    low = min([*scales, HEALTHY_SCALE]) / 2
    high = max([*scales, HEALTHY_SCALE]) * 2
    tick_values, tick_text = log2_ticks(low, high)
    domains = ([0.70, 1.0], [0.36, 0.64], [0.0, 0.30])
    titles = ("loss", "loss scale (log2)", "final-layer act norm (max)")
    layout: dict[str, Any] = {"title": _title(title), "height": 720, "hovermode": "x"}
    for row, (domain, axis_title) in enumerate(zip(domains, titles, strict=True), start=1):
        suffix = "" if row == 1 else str(row)
        layout[f"xaxis{suffix}"] = {
            "anchor": f"y{suffix}",
            "showticklabels": row == 3,
            **({"matches": "x3"} if row < 3 else {}),
        }
        layout[f"yaxis{suffix}"] = {
            "anchor": f"x{suffix}",
            "domain": domain,
            "title": {"text": axis_title},
        }
    layout["xaxis3"]["title"] = {"text": STEP_AXIS_TITLE}
    layout["yaxis2"].update(
        type="log",
        range=[math.log10(low), math.log10(high)],
        tickvals=tick_values,
        ticktext=tick_text,
    )
    layout["yaxis3"]["type"] = "log"
    layout["shapes"] = [
        {
            "type": "line",
            "xref": "x2 domain",
            "x0": 0,
            "x1": 1,
            "yref": "y2",
            "y0": HEALTHY_SCALE,
            "y1": HEALTHY_SCALE,
            "line": {"dash": "dash", "color": "#888888", "width": 1},
        }
    ]
    return figure_of(data, layout)
