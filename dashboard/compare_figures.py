"""The compare page's chart: several runs on one step axis."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ampwatch.dashboard.figure_common import (
    STEP_AXIS_TITLE,
    _title,
    empty_figure,
    figure_of,
    log2_ticks,
    plot_steps,
    plot_values,
)
from ampwatch.dashboard.series_types import StepSeries

#: A distinct colour per run on the compare page (colour-blind-safe Okabe-Ito order).
RUN_COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")


def compare_figure(runs: Sequence[tuple[str, StepSeries]]) -> go.Figure:
    """Several runs on one step axis: loss, loss scale (log2, with each run's effective
    loss_scale_collapse min_scale as the collector serves it: one dashed line per distinct
    value) and the final-layer activation norm (max over tokens, log), one colour per run."""
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
    lines = sorted({s.rule_lines.min_scale for _, s in runs if s.rule_lines is not None} - {0.0})
    low = min([*scales, *lines] or [1.0]) / 2
    high = max([*scales, *lines] or [1.0]) * 2
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
            "y0": line,
            "y1": line,
            "line": {"dash": "dash", "color": "#888888", "width": 1},
        }
        for line in lines
    ]
    return figure_of(data, layout)
