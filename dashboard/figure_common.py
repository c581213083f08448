"""What every chart shares: the values as plotly draws them (non-finite points are gaps),
the layout template and colours, titles, messages and log2 ticks.

Non-finite values are data here, not errors: a NaN or infinite point is drawn as a gap in
its line (plotly breaks a line at None), and a non-finite loss is also marked, because a
gap alone is easy to miss and a NaN loss is divergence, not a scaling hiccup.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import plotly.graph_objects as go

STEP_AXIS_TITLE = "optimizer step"

SKIPPED_COLOR = "#d62728"

NON_FINITE_COLOR = "#ff7f0e"

SCALE_COLOR = "#1f77b4"

LOSS_COLOR = "#444444"

CHECKPOINT_COLOR = "#2ca02c"

#: Steps a resume abandoned (`AbandonedTail`): drawn under the live branch, greyed.
ABANDONED_COLOR = "#b8b8b8"

FROZEN_COLOR = "#d62728"

MAX_LOG2_TICKS = 10

UI_REVISION = "keep"

SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}

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
