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
from collections.abc import Sequence
from datetime import datetime, timezone

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ampwatch.dashboard.client import LayerMatrix, StepSeries

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

# Zero-gradient fraction: pale to dark blue as a layer's share of exact zeros grows, and a
# jump to red only at exactly 1.0, so a frozen layer stands out from a merely sparse one.
ZERO_FRACTION_COLORSCALE: list[list[float | str]] = [
    [0.0, "#f7fbff"],
    [0.5, "#6baed6"],
    [0.999, "#08306b"],
    [1.0, FROZEN_COLOR],
]

_BASE_LAYOUT = {
    "template": "plotly_white",
    # The legend sits between the title and the plot; the top margin leaves room for both.
    "margin": {"l": 70, "r": 30, "t": 90, "b": 50},
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


def empty_figure(title: str, message: str) -> go.Figure:
    """A figure that says why there is nothing to draw, instead of empty axes."""
    figure = go.Figure()
    figure.update_layout(
        title=title,
        template="plotly_white",
        xaxis={"visible": False},
        yaxis={"visible": False},
        annotations=[
            {
                "text": message,
                "xref": "paper",
                "yref": "paper",
                "x": 0.5,
                "y": 0.5,
                "showarrow": False,
                "font": {"size": 14, "color": "#666666"},
            }
        ],
        height=300,
    )
    return figure


def log2_ticks(low: float, high: float) -> tuple[list[float], list[str]]:
    """Tick values and `2^k` labels within [low, high] (both > 0), at most `MAX_LOG2_TICKS`.

    >>> log2_ticks(0.5, 4.0)
    ([0.5, 1.0, 2.0, 4.0], ['2<sup>-1</sup>', '2<sup>0</sup>', '2<sup>1</sup>', '2<sup>2</sup>'])
    """
    k_low, k_high = math.floor(math.log2(low)), math.ceil(math.log2(high))
    stride = max(1, math.ceil((k_high - k_low + 1) / MAX_LOG2_TICKS))
    exponents = range(-(-k_low // stride) * stride, k_high + 1, stride)
    return [2.0**k for k in exponents], [f"2<sup>{k}</sup>" for k in exponents]


def loss_scale_figure(series: StepSeries, *, checkpoint_steps: Sequence[int] = ()) -> go.Figure:
    """Loss scale on a log2 axis over loss, sharing the step axis.

    Top: the scale as a step line, a dashed line at 1.0 (the healthy floor), a red x at
    every skipped step, dotted verticals at checkpoints. Bottom: the loss, with gaps and
    orange triangles (on the top edge of the loss range) where it was NaN or infinite.
    """
    title = "Loss scale and loss"
    if not series.step:
        return empty_figure(title, "No steps reported for this run yet.")

    scales = [
        s if s is not None and math.isfinite(s) and s > 0 else None for s in series.loss_scale
    ]
    shown = [s for s in scales if s is not None]
    # 1.0 is always in range: how far the scale sits above it is the point of the chart.
    low = min([*shown, HEALTHY_SCALE]) / 2
    high = max([*shown, HEALTHY_SCALE]) * 2
    tick_values, tick_text = log2_ticks(low, high)

    figure = make_subplots(
        rows=2, cols=1, shared_xaxes=True, row_heights=[0.6, 0.4], vertical_spacing=0.06
    )
    figure.add_trace(
        go.Scatter(
            x=series.step,
            y=scales,
            name="loss scale",
            mode="lines",
            line={"shape": "hv", "color": SCALE_COLOR},
            hovertemplate="%{y:.6g}",
        ),
        row=1,
        col=1,
    )
    skipped = [i for i, was_skipped in enumerate(series.skipped) if was_skipped]
    figure.add_trace(
        go.Scatter(
            x=[series.step[i] for i in skipped],
            # A skipped step whose scale is unknown still shows, on the axis floor.
            y=[scales[i] if scales[i] is not None else low for i in skipped],
            name=f"skipped step ({len(skipped)})",
            mode="markers",
            marker={"symbol": "x", "size": 9, "color": SKIPPED_COLOR},
            hovertemplate="skipped",
        ),
        row=1,
        col=1,
    )
    figure.add_hline(
        y=HEALTHY_SCALE, line={"dash": "dash", "color": "#888888", "width": 1}, row=1, col=1
    )
    for step in checkpoint_steps:
        figure.add_vline(
            x=step,
            line={"dash": "dot", "color": CHECKPOINT_COLOR, "width": 1},
            annotation_text="ckpt",
            annotation_position="top",
            annotation_font={"size": 10, "color": CHECKPOINT_COLOR},
        )

    losses = [finite_or_none(v) for v in series.loss]
    figure.add_trace(
        go.Scatter(
            x=series.step,
            y=losses,
            name="loss",
            mode="lines",
            line={"color": LOSS_COLOR, "width": 1.5},
            connectgaps=False,
            hovertemplate="%{y:.4g}",
        ),
        row=2,
        col=1,
    )
    non_finite = [i for i, v in enumerate(series.loss) if v is not None and not math.isfinite(v)]
    if non_finite:
        ceiling = max((v for v in losses if v is not None), default=0.0)
        figure.add_trace(
            go.Scatter(
                x=[series.step[i] for i in non_finite],
                y=[ceiling] * len(non_finite),
                customdata=[str(series.loss[i]) for i in non_finite],
                name="non-finite loss",
                mode="markers",
                marker={"symbol": "triangle-up", "size": 10, "color": NON_FINITE_COLOR},
                hovertemplate="loss %{customdata}",
            ),
            row=2,
            col=1,
        )

    if not shown:
        # An empty log axis would read as "no data yet"; say what it really means.
        figure.add_annotation(
            text=NO_SCALER_MESSAGE,
            xref="x domain",
            yref="y domain",
            x=0.5,
            y=0.5,
            showarrow=False,
            font={"size": 13, "color": "#666666"},
        )

    figure.update_layout(title=title, height=480, **_BASE_LAYOUT)
    figure.update_yaxes(
        type="log",
        range=[math.log10(low), math.log10(high)],
        tickvals=tick_values,
        ticktext=tick_text,
        title_text="loss scale (log2)",
        row=1,
        col=1,
    )
    figure.update_yaxes(title_text="loss", row=2, col=1)
    figure.update_xaxes(title_text=STEP_AXIS_TITLE, row=2, col=1)
    return figure


def activation_norm_figure(series: StepSeries) -> go.Figure:
    """Final-layer activation L2 norm, max and mean over tokens (the OPT-175B precursor)."""
    title = "Final-layer activation norm"
    means = [finite_or_none(v) for v in series.act_norm_mean]
    maxima = [finite_or_none(v) for v in series.act_norm_max]
    if not any(v is not None for v in means + maxima):
        return empty_figure(title, "No final-layer activation norm reported for this run yet.")
    figure = go.Figure()
    figure.add_trace(
        go.Scatter(
            x=series.step,
            y=maxima,
            name="max over tokens",
            mode="lines",
            line={"color": "#9467bd"},
            hovertemplate="%{y:.4g}",
        )
    )
    figure.add_trace(
        go.Scatter(
            x=series.step,
            y=means,
            name="mean over tokens",
            mode="lines",
            line={"color": SCALE_COLOR},
            hovertemplate="%{y:.4g}",
        )
    )
    figure.update_layout(
        title=title,
        height=320,
        xaxis_title=STEP_AXIS_TITLE,
        yaxis_title="activation L2 norm",
        **_BASE_LAYOUT,
    )
    return figure


def zero_fraction_heatmap(matrix: LayerMatrix) -> go.Figure:
    """Layers × steps heatmap of the share of each layer's gradient elements exactly zero.

    Rows follow the collector's layer order (model order), first layer on top; a cell at
    1.0 (every gradient element zero: the layer is not learning) is drawn red.
    """
    title = "Zero-gradient fraction per layer"
    if not matrix.layers or not matrix.steps:
        return empty_figure(
            title, "No per-layer gradient statistics yet (the agent samples them every N steps)."
        )
    z = [
        [finite_or_none(row[j]) if j < len(row) else None for row in matrix.values]
        for j in range(len(matrix.layers))
    ]
    figure = go.Figure(
        go.Heatmap(
            x=matrix.steps,
            y=matrix.layers,
            z=z,
            zmin=0.0,
            zmax=1.0,
            colorscale=ZERO_FRACTION_COLORSCALE,
            colorbar={"title": {"text": "zero-gradient<br>fraction"}},
            hovertemplate="%{y}<br>step %{x}<br>zero-gradient fraction %{z:.3f}<extra></extra>",
        )
    )
    figure.update_layout(
        title={
            "text": title,
            "subtitle": {
                "text": f"<span style='color:{FROZEN_COLOR}'>red</span>: frozen layer, "
                "every gradient element exactly zero"
            },
        },
        height=max(320, 160 + 22 * len(matrix.layers)),
        template="plotly_white",
        uirevision=UI_REVISION,
        margin={"l": 70, "r": 30, "t": 90, "b": 50},
        xaxis_title=STEP_AXIS_TITLE,
        yaxis={"title": {"text": "layer"}, "autorange": "reversed", "automargin": True},
    )
    return figure
