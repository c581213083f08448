"""The layers x steps heatmap of one per-layer gradient statistic, its bucket grid and its
row labels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import plotly.graph_objects as go

from ampwatch.dashboard.figure_common import (
    FROZEN_COLOR,
    MARGIN,
    STEP_AXIS_TITLE,
    _title,
    _x_axis,
    empty_figure,
    figure_of,
    plot_values,
)
from ampwatch.dashboard.series_types import LayerMatrix

# Zero-gradient fraction: pale to dark blue as a layer's share of exact zeros grows, and a
# jump to red only at exactly 1.0, so a frozen layer stands out from a merely sparse one.
ZERO_FRACTION_COLORSCALE: list[list[float | str]] = [
    [0.0, "#f7fbff"],
    [0.5, "#6baed6"],
    [0.999, "#08306b"],
    [1.0, FROZEN_COLOR],
]


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
