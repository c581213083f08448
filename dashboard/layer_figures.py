"""Figures of one layer's drill-down page: its statistics over steps, and its gradient
exponent histogram drawn against the FP8/FP16/BF16 representable ranges.

The histogram's bins are the float32 exponent field f of the unscaled gradient g
(`ampwatch.agent.wire`: field f in 1..254 holds |g| in [2^(f-127), 2^(f-126)), field 0
zeros and float32 subnormals, 255 Inf/NaN). Under a loss scale S the backward pass computes
g·S, so each bin is drawn at log2|g·S| = f - 127 + log2 S: the formats' ranges stay put and
the histogram slides against them as the scale moves, and the part left of 2^-24 is what
FP16 would flush to zero (the underflow cliff).

    >>> from ampwatch.dashboard.series_types import LayerHistograms
    >>> hists = LayerHistograms("fc.weight", [10], [100], [[1, 3]])
    >>> exponent_histogram_figure(hists, [2.0**10]).data[0].x
    (-16.5, -15.5)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from ampwatch.agent.wire import EXPONENT_BIAS, EXPONENT_HISTOGRAM_BINS, FP16_MAX
from ampwatch.dashboard.figure_common import (
    STEP_AXIS_TITLE,
    empty_figure,
    figure_of,
    format_loss_scale,
    plot_steps,
    plot_values,
    two_rows,
)
from ampwatch.dashboard.series_types import LayerHistograms, LayerSeries

ZERO_FIELD = 0
NON_FINITE_FIELD = EXPONENT_HISTOGRAM_BINS - 1


@dataclass(frozen=True)
class FloatFormat:
    """A floating-point format's magnitudes as log2 values: smallest subnormal, smallest
    normal, largest finite."""

    name: str
    min_subnormal: float
    min_normal: float
    max: float


FORMATS = (
    FloatFormat("BF16", -133.0, -126.0, math.log2(3.3895313892515355e38)),
    FloatFormat("FP16", -24.0, -14.0, math.log2(FP16_MAX)),
    FloatFormat("FP8 E5M2", -16.0, -14.0, math.log2(57344.0)),
    FloatFormat("FP8 E4M3", -9.0, -6.0, math.log2(448.0)),
)
FP16 = FORMATS[1]
#: The x axis always shows at least FP16's whole range with a margin.
MIN_X_RANGE = (FP16.min_subnormal - 6.0, FP16.max + 4.0)
BAR_COLOR = "#1f77b4"
NORMAL_COLOR = "rgba(44, 160, 44, 0.75)"
SUBNORMAL_COLOR = "rgba(255, 187, 40, 0.8)"
FLUSH_COLOR = "#d62728"

STAT_NAMES = {
    "zero_fraction": "exactly zero",
    "subnormal_fraction": "FP16 subnormal (|g·S| in [2^-24, 2^-14))",
    "flush_fraction": "would flush in FP16 (0 < |g·S| < 2^-24)",
}
STAT_COLORS = {
    "zero_fraction": "#d62728",
    "subnormal_fraction": "#ff7f0e",
    "flush_fraction": "#9467bd",
}


def layer_series_figure(
    series: Mapping[str, LayerSeries], max_abs: LayerSeries | None
) -> go.Figure:
    """Top: the layer's zero, FP16-subnormal and flush shares (0..1). Bottom: max |g·S|
    on a log axis against FP16's 65504 ceiling (overflow headroom)."""
    title = "Gradient statistics of this layer"
    if not any(s.step for s in series.values()) and not (max_abs and max_abs.step):
        return empty_figure(title, "No statistics sampled for this layer yet.")
    data: list[dict[str, Any]] = [
        {
            "type": "scatter",
            "x": plot_steps(series[stat].step),
            "y": plot_values(series[stat].value),
            "name": label,
            "mode": "lines",
            "line": {"color": STAT_COLORS[stat], "width": 1.5},
            "hovertemplate": "%{y:.3f}",
        }
        for stat, label in STAT_NAMES.items()
        if stat in series
    ]
    layout = two_rows(0.6, gap=0.08)
    layout["yaxis"].update(title={"text": "share of elements"}, range=[0, 1.02])
    layout["yaxis2"].update(title={"text": "max |g·S|"}, type="log")
    layout["xaxis2"].update(title={"text": STEP_AXIS_TITLE})
    if max_abs is not None:
        data.append(
            {
                "type": "scatter",
                "x": plot_steps(max_abs.step),
                "y": plot_values(max_abs.value, positive=True),
                "name": "max |g·S|",
                "mode": "lines",
                "xaxis": "x2",
                "yaxis": "y2",
                "line": {"color": "#444444", "width": 1.5},
                "hovertemplate": "%{y:.4g}",
            }
        )
        layout["shapes"] = [
            {
                "type": "line",
                "xref": "x2 domain",
                "x0": 0,
                "x1": 1,
                "yref": "y2",
                "y0": FP16_MAX,
                "y1": FP16_MAX,
                "line": {"dash": "dash", "color": FLUSH_COLOR, "width": 1},
            }
        ]
        layout["annotations"] = [
            {
                "text": "FP16 max 65504",
                "xref": "x2 domain",
                "x": 0,
                "xanchor": "left",
                "yref": "y2",
                "y": math.log10(FP16_MAX),
                "yanchor": "bottom",
                "showarrow": False,
                "font": {"size": 10, "color": FLUSH_COLOR},
            }
        ]
    return figure_of(data, {"title": {"text": title}, "height": 480, **layout})


def scale_exponent(scale: float | None) -> float:
    """log2 of the loss scale in effect, 0 when there is none (or it is unusable)."""
    if scale is None or not math.isfinite(scale) or scale <= 0:
        return 0.0
    return math.log2(scale)


#: A histogram's frame as drawn: bar centres (log2|g·S|), shares, the note on the rest.
Bars = tuple[list[float], list[float], str]


def _histogram_bars(offset: int, counts: Sequence[int], shift: float) -> Bars:
    """Bar centres (log2|g·S|), shares of all elements, and the note on what is not a bar."""
    total = sum(counts) or 1
    x: list[float] = []
    y: list[float] = []
    zeros = non_finite = 0
    for j, count in enumerate(counts):
        field = offset + j
        if field == ZERO_FIELD:
            zeros = count
        elif field == NON_FINITE_FIELD:
            non_finite = count
        elif count:
            x.append(field - EXPONENT_BIAS + shift + 0.5)
            y.append(count / total)
    note = f"exactly zero (or float32 subnormal): {zeros / total:.1%}"
    if non_finite:
        note += f" · Inf/NaN: {non_finite / total:.1%}"
    return x, y, note


def _frame_title(layer: str, step: int, scale: float | None, note: str) -> dict[str, object]:
    return {
        "text": f"Gradient exponents of {layer} at step {step:,}",
        "subtitle": {"text": f"|g·S| at loss scale S = {format_loss_scale(scale)} · {note}"},
    }


def _axis_ranges(frames: Sequence[Bars]) -> tuple[float, float, float]:
    """(x low, x high, y high) that hold every frame's bars, FP16's whole range with a
    margin included: the axes stay put while the animation plays."""
    shown = [x for xs, _, _ in frames for x in xs]
    x_low = min([*shown, MIN_X_RANGE[0] + 0.5]) - 1.5
    x_high = max([*shown, MIN_X_RANGE[1] - 0.5]) + 1.5
    y_high = max([y for _, ys, _ in frames for y in ys] or [1.0]) * 1.1
    return x_low, x_high, y_high


def _ruler_traces() -> list[dict[str, Any]]:
    """The format ruler under the histogram: each format's normal range solid, its
    subnormal range paler."""
    names = [f.name for f in FORMATS]
    return [
        {
            "type": "bar",
            "orientation": "h",
            "y": names,
            "xaxis": "x2",
            "yaxis": "y2",
            "base": [f.min_normal for f in FORMATS],
            "x": [f.max - f.min_normal for f in FORMATS],
            "name": "normal range",
            "marker": {"color": NORMAL_COLOR},
            "width": 0.6,
            "customdata": [[f.min_normal, f.max] for f in FORMATS],
            "hovertemplate": "%{y} normal: 2^%{customdata[0]:.0f} .. 2^%{customdata[1]:.2f}"
            "<extra></extra>",
        },
        {
            "type": "bar",
            "orientation": "h",
            "y": names,
            "xaxis": "x2",
            "yaxis": "y2",
            "base": [f.min_subnormal for f in FORMATS],
            "x": [f.min_normal - f.min_subnormal for f in FORMATS],
            "name": "subnormal range",
            "marker": {"color": SUBNORMAL_COLOR},
            "width": 0.6,
            "customdata": [[f.min_subnormal, f.min_normal] for f in FORMATS],
            "hovertemplate": "%{y} subnormal: 2^%{customdata[0]:.0f} .. 2^%{customdata[1]:.0f}"
            "<extra></extra>",
        },
    ]


def _fp16_zones(x_low: float, x_high: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(bands, labels) of FP16's zones on the histogram itself: the cliff below 2^-24, the
    subnormal and normal ranges, overflow above 65504."""
    zones = (
        (x_low, FP16.min_subnormal, FLUSH_COLOR, 0.12, "flushes to 0 in FP16"),
        (FP16.min_subnormal, FP16.min_normal, SUBNORMAL_COLOR, 0.25, "FP16 subnormal"),
        (FP16.min_normal, FP16.max, NORMAL_COLOR, 0.08, "FP16 normal"),
        (FP16.max, x_high, FLUSH_COLOR, 0.12, "overflows FP16"),
    )
    shapes = [
        {
            "type": "rect",
            "xref": "x",
            "yref": "y domain",
            "x0": x0,
            "x1": x1,
            "y0": 0,
            "y1": 1,
            "fillcolor": color,
            "opacity": opacity,
            "line": {"width": 0},
            "layer": "below",
        }
        for x0, x1, color, opacity, _ in zones
    ]
    annotations = [
        {
            "text": label,
            "xref": "x",
            "x": x0,
            "xanchor": "left",
            "yref": "y domain",
            "y": 1,
            "yanchor": "top",
            "showarrow": False,
            "font": {"size": 11},
        }
        for x0, _, _, _, label in zones
    ]
    return shapes, annotations


def _animation_controls(steps: Sequence[int], active: int) -> dict[str, Any]:
    """The layout's step slider (at frame `active`) and play / pause buttons."""
    redraw = {
        "frame": {"duration": 0, "redraw": True},
        "mode": "immediate",
        "transition": {"duration": 0},
    }
    play = {**redraw, "frame": {"duration": 400, "redraw": True}, "fromcurrent": True}
    return {
        "sliders": [
            {
                "active": active,
                "currentvalue": {"prefix": "step "},
                "pad": {"t": 64},
                "steps": [
                    {"label": f"{step:,}", "method": "animate", "args": [[str(step)], redraw]}
                    for step in steps
                ],
            }
        ],
        "updatemenus": [
            {
                "type": "buttons",
                "direction": "left",
                "x": 0,
                "y": 0,
                "xanchor": "right",
                "yanchor": "top",
                "pad": {"t": 84, "r": 10},
                "buttons": [
                    {"label": "▶ play", "method": "animate", "args": [None, play]},
                    {"label": "❚❚", "method": "animate", "args": [[None], redraw]},
                ],
            }
        ],
    }


def exponent_histogram_figure(
    hists: LayerHistograms, scales: Sequence[float | None], *, active: int | None = None
) -> go.Figure:
    """The layer's exponent histogram at each of `hists.steps` (`scales[i]`: the loss scale
    at that step), as animation frames with a step slider and a play button, over the
    format ruler. `active`: the frame shown first (default: the latest)."""
    title = "Gradient exponent histogram"
    if not hists.steps:
        return empty_figure(title, "No exponent histograms sampled for this layer yet.")
    active = len(hists.steps) - 1 if active is None else max(0, min(active, len(hists.steps) - 1))
    frames_data = [
        _histogram_bars(offset, counts, scale_exponent(scale))
        for offset, counts, scale in zip(hists.offsets, hists.counts, scales, strict=True)
    ]
    x_low, x_high, y_high = _axis_ranges(frames_data)
    x, y, note = frames_data[active]
    data: list[dict[str, Any]] = [
        {
            "type": "bar",
            "x": x,
            "y": y,
            "width": 0.9,
            "name": "share of elements",
            "marker": {"color": BAR_COLOR},
            "hovertemplate": "|g·S| ≈ 2^%{x:.0f}: %{y:.2%}<extra></extra>",
        },
        *_ruler_traces(),
    ]
    shapes, annotations = _fp16_zones(x_low, x_high)
    frames = [
        {
            "name": str(step),
            "data": [{"type": "bar", "x": fx, "y": fy}],
            "traces": [0],
            "layout": {"title": _frame_title(hists.layer, step, scale, fnote)},
        }
        for step, scale, (fx, fy, fnote) in zip(hists.steps, scales, frames_data, strict=True)
    ]
    layout = two_rows(0.72, gap=0.04)
    layout["xaxis"].update(range=[x_low, x_high])
    layout["xaxis2"].update(
        range=[x_low, x_high], dtick=4, title={"text": "log2 |g·S| (scaled gradient magnitude)"}
    )
    layout["yaxis"].update(title={"text": "share of elements"}, tickformat=".0%", range=[0, y_high])
    layout["yaxis2"].update(autorange="reversed")
    layout.update(
        title=_frame_title(hists.layer, hists.steps[active], scales[active], note),
        height=580,
        barmode="overlay",
        bargap=0,
        showlegend=False,
        hovermode="closest",
        margin={"l": 80, "r": 30, "t": 90, "b": 130},
        shapes=shapes,
        annotations=annotations,
        **_animation_controls(hists.steps, active),
    )
    return figure_of(data, layout, frames)
