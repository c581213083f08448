"""Pure figures of the FP8 readiness page, from the collector's JSON answers; no Dash, no I/O.

>>> fig = readiness_matrix_figure({"layers": [], "recipes": {}, "steps": []})
>>> fig.layout.annotations[0].text
'No FP8 samples yet: the agent measures every fp8_stats_every steps.'
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ampwatch.dashboard.figure_common import STEP_AXIS_TITLE, empty_figure, figure_of
from ampwatch.dashboard.heatmap_figures import label_margin, short_label

VERDICT_LABELS = {
    "fits": "fits (per-tensor FP8)",
    "needs_finer_scaling": "needs finer scaling",
    "keep_bf16": "keep in BF16",
}
#: Score = worst role's ratio to its limit; the colour turns at 1 (the limit), on a log axis
#: capped at 1000x so one hopeless layer does not wash out the rest.
SCORE_CAP = 1000.0
SCORE_COLORSCALE: list[list[float | str]] = [
    [0.0, "#edf8e9"],
    [0.499, "#74c476"],
    [0.5, "#fdae6b"],
    [1.0, "#a50f15"],
]
MATRIX_ROWS = 40
TREND_LAYERS = 6
NO_SAMPLES = "No FP8 samples yet: the agent measures every fp8_stats_every steps."


def _log_score(score: float | None) -> float | None:
    """log10 of the score, clamped to [-3, 3] so 1 (the limit) sits in the middle."""
    if score is None or math.isnan(score):
        return None
    return max(-3.0, min(3.0, math.log10(max(score, 1e-3)) if score < SCORE_CAP else 3.0))


def _pct(value: float) -> str:
    return f"{value:.1%}" if value >= 0.001 or value == 0 else f"{value:.2e}"


def cell_text(fit: dict[str, Any]) -> str:
    """Hover text of one layer x recipe cell: each role's flush / saturate / error."""
    lines = [f"{'fits' if fit['fits'] else 'does not fit'} (score {fit['score']:.2f})"]
    for role, m in fit["roles"].items():
        lines.append(
            f"{role} {m['format'].upper()} {m['scaling']}: flush {_pct(m['flush'])}, "
            f"saturate {_pct(m['saturate'])}, error {m['error']:.3f}"
        )
    return "<br>".join(lines)


def readiness_matrix_figure(readiness: dict[str, Any], rows: int = MATRIX_ROWS) -> go.Figure:
    """Layers (worst first, as the collector orders them) x recipes, coloured by score on a
    log scale: green within the limits, orange to red beyond them."""
    layers = readiness["layers"][:rows]
    title = "FP8 readiness: layers × recipes"
    if not layers:
        return empty_figure(title, NO_SAMPLES)
    recipes = list(readiness["recipes"])
    names = [short_label(layer["layer"]) for layer in layers]
    z = [[_log_score(layer["recipes"].get(r, {}).get("score")) for r in recipes]
         for layer in layers]  # fmt: skip
    text = [[cell_text(layer["recipes"][r]) if r in layer["recipes"] else "not measured"
             for r in recipes] for layer in layers]  # fmt: skip
    marks = [["✓" if layer["recipes"].get(r, {}).get("fits") else "✗" for r in recipes]
             for layer in layers]  # fmt: skip
    declared = readiness.get("declared_recipe")
    columns = [f"<b>{r}</b> (declared)" if r == declared else r for r in recipes]
    trace = {
        "type": "heatmap", "x": columns, "y": names, "z": z, "zmin": -3, "zmax": 3,
        "colorscale": SCORE_COLORSCALE, "customdata": text, "text": marks,
        "texttemplate": "%{text}", "hovertemplate": "%{y}<br>%{x}<br>%{customdata}<extra></extra>",
        "colorbar": {"title": {"text": "score<br>(1 = limit)"}, "tickvals": [-3, -2, -1, 0, 1, 2, 3],
                     "ticktext": ["0.001", "0.01", "0.1", "1", "10", "100", "≥1000"]},
    }  # fmt: skip
    step = readiness.get("step")
    return figure_of(
        [trace],
        {
            "title": {"text": title, "subtitle": {"text": f"at step {step:,}; worst layers first"}},
            "height": 160 + 22 * len(layers),
            "margin": {"l": label_margin(names), "r": 30, "t": 90, "b": 40},
            "yaxis": {"autorange": "reversed", "type": "category"},
            "xaxis": {"side": "top", "type": "category"},
        },
    )


def readiness_trend_figure(
    readiness: dict[str, Any], recipe: str | None = None, layers: int = TREND_LAYERS
) -> go.Figure:
    """The score of the worst layers under `recipe` (default: the declared one, else
    per-tensor) at each sampled step, with the limit at 1: a layer that fits early and
    crosses the line later is the late divergence FP8 studies report."""
    recipe = recipe or readiness.get("declared_recipe") or "per_tensor"
    title = f"Score over the run under {recipe}"
    steps = readiness.get("steps") or []
    shown = readiness["layers"][:layers]
    if not shown or not steps:
        return empty_figure(title, NO_SAMPLES)
    traces = []
    for layer in shown:
        series = layer["trend"].get(recipe) or [None] * len(steps)
        values = np.array([np.nan if v is None else min(v, SCORE_CAP) for v in series])
        traces.append({"type": "scatter", "mode": "lines+markers", "name": layer["layer"],
                       "x": steps, "y": np.maximum(values, 1e-3)})  # fmt: skip
    return figure_of(traces, {
        "title": {"text": title, "subtitle": {"text": "1 = the limit; above it, the recipe "
                                                      "does not fit"}},
        "height": 360,
        "xaxis": {"title": {"text": STEP_AXIS_TITLE}},
        "yaxis": {"type": "log", "title": {"text": "score"}},
        "shapes": [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": 1, "y1": 1,
                    "line": {"color": "#d62728", "dash": "dash"}}],
    })  # fmt: skip


def verdict_rows(readiness: dict[str, Any]) -> list[dict[str, str]]:
    """One table row per layer, worst first: verdict, the recipes it fits, the reason, and
    the step at which a recipe that fitted stopped fitting."""
    rows = []
    for layer in readiness["layers"]:
        stopped = ", ".join(f"{r} at step {s:,}" for r, s in layer["stopped_fitting"].items()
                            if s is not None)  # fmt: skip
        rows.append(
            {
                "layer": layer["layer"],
                "verdict": VERDICT_LABELS[layer["verdict"]],
                "fits with": ", ".join(layer["fits_with"]) or "—",
                "why": layer["reason"],
                "stopped fitting": stopped or "—",
            }
        )
    return rows


def loss_scale_figure(advice: dict[str, Any]) -> go.Figure:
    """Flush and (at most) overflow shares of the gradients at each S = 2^k, the clean
    range shaded and the suggested init_scale marked."""
    title = "Loss scale: FP16 flush and overflow by scale"
    table = advice.get("table") or []
    if not table:
        return empty_figure(title, advice.get("reason") or "no exponent histograms yet")
    ks = [row["exponent"] for row in table]
    traces = [
        {"type": "bar", "name": "would flush to zero", "x": ks,
         "y": [row["flush"] for row in table], "marker": {"color": "#9467bd"}},
        {"type": "bar", "name": "may overflow", "x": ks,
         "y": [row["overflow"] for row in table], "marker": {"color": "#d62728"}},
    ]  # fmt: skip
    shapes = []
    if advice.get("safe_range"):
        low, high = advice["safe_range"]
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": low - 0.5,
                       "x1": high + 0.5, "y0": 0, "y1": 1, "fillcolor": "#2ca02c",
                       "opacity": 0.12, "line": {"width": 0}})  # fmt: skip
    if advice.get("init_scale"):
        k = round(math.log2(advice["init_scale"]))
        shapes.append(
            {
                "type": "line",
                "xref": "x",
                "yref": "paper",
                "x0": k,
                "x1": k,
                "y0": 0,
                "y1": 1,
                "line": {"color": "#1f77b4", "dash": "dot"},
            }
        )
    return figure_of(traces, {
        "title": {"text": title, "subtitle": {"text": advice.get("reason", "")[:160]}},
        "height": 340, "barmode": "group", "shapes": shapes,
        "xaxis": {"title": {"text": "log2 S"}, "dtick": 1},
        "yaxis": {"title": {"text": "share of gradient elements"}, "tickformat": ".1%"},
    })  # fmt: skip
