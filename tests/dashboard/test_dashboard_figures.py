from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import plotly.graph_objects as go
import pytest

from ampwatch.dashboard import (
    alert_figures,
    compare_figures,
    figure_common,
    heatmap_figures,
    loss_scale_figures,
    step_figures,
)
from ampwatch.dashboard.run_types import Alert
from ampwatch.dashboard.series_types import LayerMatrix, StepSeries


def trace(figure: go.Figure, name: str) -> Any:
    (match,) = [t for t in figure.data if t.name == name]
    return match


def values(array: Any) -> list[Any]:
    """A trace's values as a list, NaN (a gap in plotly.js) as None."""
    return [None if isinstance(v, float) and math.isnan(v) else v for v in list(array)]


@pytest.fixture
def series(steps_json: dict[str, Any]) -> StepSeries:
    return StepSeries.from_json(steps_json)


def test_loss_scale_axis_is_log_with_power_of_two_ticks(series: StepSeries) -> None:
    figure = loss_scale_figures.loss_scale_figure(series)
    yaxis = figure.layout.yaxis
    assert yaxis.type == "log"
    assert yaxis.title.text == "loss scale (log2)"
    assert all(math.log2(v).is_integer() for v in yaxis.tickvals)
    assert "2<sup>16</sup>" in yaxis.ticktext
    # The range always reaches below 1.0, so the healthy line is visible at 2^16 too.
    low, high = yaxis.range
    assert 10**low < 1.0 and 10**high > 65536.0


def test_loss_scale_draws_the_lines_the_collector_says_its_rules_use(
    series: StepSeries,
) -> None:
    """Was: a dashed line at the constant 1.0. Now the run's effective min_scale, and the
    scaler floor and headroom line when the run reported a floor, each named."""
    line = trace(loss_scale_figures.loss_scale_figure(series), "min_scale (loss_scale_collapse)")
    assert values(line.y) == [1.0, 1.0] and line.line.dash == "dash"
    assert line.yaxis in (None, "y")  # on the loss-scale row, not the loss row
    assert series.rule_lines is not None
    moved = replace(series, rule_lines=replace(series.rule_lines, min_scale=0.25,
                                                scaler_floor=2.0**-4, floor_headroom_scale=1.0))  # fmt: skip
    figure = loss_scale_figures.loss_scale_figure(moved)
    assert values(trace(figure, "min_scale (loss_scale_collapse)").y) == [0.25, 0.25]
    assert values(trace(figure, "scaler floor (run_start)").y) == [2.0**-4] * 2
    assert values(trace(figure, "floor x 2^4 (loss_scale_collapse)").y) == [1.0, 1.0]
    assert 10 ** figure.layout.yaxis.range[0] < 2.0**-4  # every line in range
    # No rule lines (a collector before them): nothing is drawn as if it were the rule's.
    bare = loss_scale_figures.loss_scale_figure(replace(series, rule_lines=None))
    assert not [t for t in bare.data if "loss_scale_collapse" in (t.name or "")]


def test_run_without_scaler_says_so_instead_of_empty_axes(steps_json: dict[str, Any]) -> None:
    no_scaler = StepSeries.from_json({**steps_json, "loss_scale": [None] * len(steps_json["step"])})
    texts = [a.text for a in loss_scale_figures.loss_scale_figure(no_scaler).layout.annotations]
    assert loss_scale_figures.NO_SCALER_MESSAGE in texts
    texts = [
        a.text
        for a in loss_scale_figures.loss_scale_figure(
            StepSeries.from_json(steps_json)
        ).layout.annotations
    ]
    assert loss_scale_figures.NO_SCALER_MESSAGE not in texts


def test_skipped_markers_sit_at_exactly_the_skipped_steps(series: StepSeries) -> None:
    skipped = trace(loss_scale_figures.loss_scale_figure(series), "skipped step (2)")
    assert list(skipped.x) == [3, 5]
    assert list(skipped.y) == [65536.0, 32768.0]
    assert skipped.mode == "markers" and skipped.marker.symbol == "x"
    assert skipped.name == "skipped step (2)"


def test_non_finite_loss_is_a_gap_and_a_marker(series: StepSeries) -> None:
    figure = loss_scale_figures.loss_scale_figure(series)
    loss = trace(figure, "loss")
    assert values(loss.y) == [2.5, 2.4, None, 2.2, None, 2.0]
    assert loss.yaxis == "y2"
    marked = trace(figure, "non-finite loss")
    assert list(marked.x) == [3, 5]
    assert list(marked.customdata) == ["inf", "nan"]
    assert list(marked.y) == [2.5, 2.5]  # on the top edge of the finite losses


def test_no_non_finite_marker_trace_when_every_loss_is_finite() -> None:
    series = StepSeries.from_json({"step": [1, 2], "loss": [1.0, 0.9], "loss_scale": [2.0, 2.0]})
    names = [t.name for t in loss_scale_figures.loss_scale_figure(series).data]
    assert names == ["loss scale", "skipped step (0)", "loss"]


def test_non_positive_or_non_finite_scale_is_a_gap_not_a_log_error() -> None:
    series = StepSeries.from_json(
        {"step": [1, 2, 3], "loss_scale": [4.0, "NaN", 0.0], "skipped": [False, True, True]}
    )
    figure = loss_scale_figures.loss_scale_figure(series)
    assert values(trace(figure, "loss scale").y) == [4.0, None, None]
    # Skips whose scale is unknown still show, on the axis floor.
    low = 10 ** figure.layout.yaxis.range[0]
    assert list(trace(figure, "skipped step (2)").y) == pytest.approx([low, low])


def test_checkpoints_are_vertical_lines(series: StepSeries) -> None:
    figure = loss_scale_figures.loss_scale_figure(series, checkpoints={4: ""})
    verticals = [s for s in figure.layout.shapes if s.x0 == 4 and s.x1 == 4]
    assert len(verticals) == 1 and verticals[0].line.dash == "dot"
    assert [a.text for a in figure.layout.annotations] == ["ckpt"]


def test_activation_norm_has_mean_and_max_with_gaps(series: StepSeries) -> None:
    figure = step_figures.activation_norm_figure(series)
    assert values(trace(figure, "mean over tokens").y) == [7.9, 8.0, 8.1, None, 8.3, 8.4]
    assert values(trace(figure, "max over tokens").y) == [11.2, 11.0, 12.5, 13.0, 40.0, 12.0]
    assert figure.layout.yaxis.title.text == "activation L2 norm"
    assert figure.layout.yaxis.type == "log"  # a spike must not flatten the baseline


def test_activation_norm_shows_the_norm_before_the_final_norm_when_measured(
    series: StepSeries,
) -> None:
    names = [t.name for t in step_figures.activation_norm_figure(series).data]
    assert "mean before the final norm" not in names  # not measured: no empty trace
    prenorm = [30.0, 31.0, None, 33.0, 90.0, 35.0]
    measured = replace(series, act_prenorm_mean=prenorm)
    figure = step_figures.activation_norm_figure(measured)
    assert values(trace(figure, "mean before the final norm").y) == prenorm


def test_heatmap_is_layers_by_steps_and_carries_values(layers_json: dict[str, Any]) -> None:
    figure = heatmap_figures.layer_heatmap(LayerMatrix.from_json(layers_json))
    (heatmap,) = figure.data
    assert list(heatmap.y) == ["embed.weight", "blocks.0.mlp.fc1.weight", "head.weight"]
    assert list(heatmap.x) == [2, 4, 6]
    z = [values(row) for row in heatmap.z.astype(float).round(4)]
    assert len(z) == 3 and all(len(row) == 3 for row in z)
    assert z[0] == [0.01, 0.02, 0.03]  # layer 0 across steps: the API's rows transposed
    assert z[1] == [0.1, None, 0.3]  # NaN is an empty cell
    assert z[2] == [1.0, 1.0, 1.0]
    assert (heatmap.zmin, heatmap.zmax) == (0.0, 1.0)
    assert heatmap.colorscale[-1] == (1.0, figure_common.FROZEN_COLOR)  # frozen stands out
    assert figure.layout.yaxis.autorange == "reversed"  # first layer on top


def test_a_downsampled_heatmap_sits_on_even_bucket_starts(layers_json: dict[str, Any]) -> None:
    """Buckets of 500 steps whose first rows are at 10, 500 and 1,520 (none in 1,000-1,499):
    columns at 0, 500, 1,000, 1,500, the empty bucket an empty column, so plotly.js can
    paint a pixel per cell; the hover says what a cell holds."""
    matrix = LayerMatrix.from_json({**layers_json, "steps": [10, 500, 1520], "step_width": 500})
    (heatmap,) = heatmap_figures.layer_heatmap(matrix).data
    assert list(heatmap.x) == [0, 500, 1000, 1500]
    z = [values(row) for row in heatmap.z.astype(float).round(4)]
    assert z[0] == [0.01, 0.02, None, 0.03] and z[2] == [1.0, 1.0, None, 1.0]
    assert "500 steps from %{x} (their maximum)" in heatmap.hovertemplate
    exact = heatmap_figures.layer_heatmap(LayerMatrix.from_json(layers_json)).data[0]
    assert "<br>step %{x}<br>" in exact.hovertemplate
    # A run resumed far ahead: its grid would be mostly empty, so rows keep their steps.
    far = LayerMatrix.from_json({**layers_json, "steps": [10, 500, 50_000_000], "step_width": 500})
    assert list(heatmap_figures.layer_heatmap(far).data[0].x) == [10, 500, 50_000_000]


def test_a_tall_heatmap_labels_at_most_fifty_rows_and_keeps_every_row() -> None:
    layers = [f"blocks.{i}.weight" for i in range(200)]
    matrix = LayerMatrix.from_json(
        {"stat": "zero_fraction", "layers": layers, "steps": [1], "values": [[0.0] * 200]}
    )
    figure = heatmap_figures.layer_heatmap(matrix)
    assert list(figure.data[0].y) == layers  # hover names every row
    ticks = list(figure.layout.yaxis.tickvals)
    assert len(ticks) == 50 and ticks[:2] == ["blocks.0.weight", "blocks.4.weight"]
    assert list(figure.layout.yaxis.ticktext) == ticks
    short = heatmap_figures.layer_heatmap(
        LayerMatrix.from_json(
            {"stat": "zero_fraction", "layers": layers[:3], "steps": [1], "values": [[0.0] * 3]}
        )
    )
    assert list(short.layout.yaxis.tickvals) == layers[:3]  # a short one labels every row


def test_row_labels_are_cut_from_the_left_and_the_margin_fits_them() -> None:
    """No automargin (a second layout pass in plotly.js): the margin is sized from the
    names, and a name too long for it keeps its distinguishing end."""
    long = "model.decoder.layers.23.self_attn.out_proj." + "x" * 40 + ".weight"
    layers = ["fc1.weight", long]
    figure = heatmap_figures.layer_heatmap(
        LayerMatrix.from_json(
            {"stat": "zero_fraction", "layers": layers, "steps": [1], "values": [[0.0, 0.0]]}
        )
    )
    text = list(figure.layout.yaxis.ticktext)
    assert text[0] == "fc1.weight"
    assert len(text[1]) == heatmap_figures.LABEL_CHARS and text[1].startswith("…")
    assert text[1].endswith("x.weight") and long.endswith(text[1][1:])
    assert figure.layout.margin.l == 20 + heatmap_figures.CHAR_PX * heatmap_figures.LABEL_CHARS
    assert list(figure.data[0].y) == layers  # hover keeps the full name
    assert heatmap_figures.label_margin(["a"]) == 70  # never narrower than the step charts'
    assert not figure.layout.template.layout.yaxis.automargin


def test_heatmap_tolerates_short_rows() -> None:
    matrix = LayerMatrix.from_json(
        {
            "stat": "zero_fraction",
            "layers": ["a", "b"],
            "steps": [1, 2],
            "values": [[0.5], [0.1, 0.2]],
        }
    )
    (heatmap,) = heatmap_figures.layer_heatmap(matrix).data
    assert [values(row) for row in heatmap.z.astype(float).round(4)] == [[0.5, 0.1], [None, 0.2]]


@pytest.mark.parametrize(
    "figure",
    [
        loss_scale_figures.loss_scale_figure(StepSeries.from_json({})),
        step_figures.activation_norm_figure(StepSeries.from_json({"step": [1], "loss": [1.0]})),
        heatmap_figures.layer_heatmap(LayerMatrix.from_json({"stat": "zero_fraction"})),
    ],
)
def test_missing_data_explains_itself(figure: go.Figure) -> None:
    assert len(figure.data) == 0
    assert "No " in figure.layout.annotations[0].text


def test_refreshes_keep_the_users_zoom(series: StepSeries, layers_json: dict[str, Any]) -> None:
    for figure in (
        loss_scale_figures.loss_scale_figure(series),
        step_figures.activation_norm_figure(series),
        heatmap_figures.layer_heatmap(LayerMatrix.from_json(layers_json)),
    ):
        assert figure.layout.uirevision == figure_common.UI_REVISION


def test_figures_serialise_without_bare_nan(
    series: StepSeries, layers_json: dict[str, Any]
) -> None:
    """Browsers reject NaN in JSON; every figure must be strict JSON."""
    for figure in (
        loss_scale_figures.loss_scale_figure(series),
        step_figures.activation_norm_figure(series),
        heatmap_figures.layer_heatmap(LayerMatrix.from_json(layers_json)),
    ):
        json.loads(figure.to_json(), parse_constant=lambda name: pytest.fail(name))


def test_log2_ticks_thin_out_over_a_wide_range() -> None:
    values, labels = figure_common.log2_ticks(2.0**-10, 2.0**32)
    assert len(values) <= figure_common.MAX_LOG2_TICKS
    assert values[0] >= 2.0**-10 and values[-1] <= 2.0**32
    assert 1.0 in values
    assert labels[values.index(1.0)] == "2<sup>0</sup>"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (65536.0, "65536 (2^16)"),
        (2.0**32, "4294967296 (2^32)"),
        (0.25, "0.25 (2^-2)"),
        (3.0, "3"),
        (None, "—"),
        (math.inf, "inf"),
    ],
)
def test_format_loss_scale(value: float | None, text: str) -> None:
    assert figure_common.format_loss_scale(value) == text


def test_format_time_is_utc_to_the_second() -> None:
    assert figure_common.format_time("2026-11-29T10:30:05.5+01:00") == "2026-11-29 09:30:05 UTC"
    assert figure_common.format_time("yesterday") == "yesterday"


def test_checkpoint_verdicts_mark_the_recommended_restart(series: StepSeries) -> None:
    figure = loss_scale_figures.loss_scale_figure(
        series, checkpoints={2: "healthy", 4: "recommended", 6: "rejected"}
    )
    verticals = {s.x0: s for s in figure.layout.shapes if s.type == "line" and s.x0 == s.x1}
    assert verticals[4].line.width == 3 and verticals[4].line.dash is None  # solid, thick
    assert verticals[2].line.dash == "dot" and verticals[6].line.color == "#9ca3af"
    labels = {a.x: a.text for a in figure.layout.annotations}
    assert labels == {2: "ckpt", 4: "restart here"}  # a rejected checkpoint is not labelled


def alert(**fields: Any) -> Alert:
    base = {
        "id": 1,
        "run_id": 7,
        "rule": "loss_scale_collapse",
        "layer": "",
        "severity": "critical",
        "status": "firing",
        "started_step": 3,
        "fired_step": 4,
        "resolved_step": None,
        "started_at": 1.0,
        "fired_at": 2.0,
        "resolved_at": None,
        "message": "loss scale 0.5 is below min_scale 1",
        "values": {"loss_scale": 0.5},
    }
    return Alert.from_json({**base, **fields})


def test_run_level_alerts_shade_the_loss_scale_chart(series: StepSeries) -> None:
    figure = loss_scale_figures.loss_scale_figure(
        series,
        alerts=[
            alert(),
            alert(id=2, rule="silent_underflow", layer="head.weight", fired_step=2),
        ],
    )
    (rect,) = [s for s in figure.layout.shapes if s.type == "rect"]
    assert (rect.x0, rect.x1) == (4, 6)  # fired at 4, still firing at the last step
    assert rect.fillcolor == figure_common.SEVERITY_COLORS["critical"]


def test_zoomed_figures_pin_the_step_axis(series: StepSeries) -> None:
    for figure in (
        loss_scale_figures.loss_scale_figure(series, x_range=(2, 5)),
        step_figures.skip_rate_figure(series, x_range=(2, 5)),
        step_figures.grad_norm_figure(series, x_range=(2, 5)),
        step_figures.activation_norm_figure(series, x_range=(2, 5)),
    ):
        assert tuple(figure.layout.xaxis.range) == (2, 5)
        assert figure.layout.xaxis.autorange is False
    assert loss_scale_figures.loss_scale_figure(series).layout.xaxis.range is None


def test_skip_rate_counts_skips_per_window() -> None:
    series = StepSeries.from_json(
        {"step": list(range(1, 11)), "skipped": [s in (3, 4, 9) for s in range(1, 11)]}
    )
    starts, rates = step_figures.skip_rates(series, buckets=2)
    assert starts == [0, 5, 10]
    assert rates == [2 / 4, 1 / 5, 0.0]  # window 0..4 holds steps 1..4 only
    bars = step_figures.skip_rate_figure(series).data[0]
    assert bars.type == "bar" and sum(bars.y) > 0


def test_skip_rate_uses_the_collectors_skip_counts_when_downsampled() -> None:
    """Downsampled points stand for many steps: skipped_count, not the skipped flag, counts."""
    series = StepSeries.from_json(
        {
            "step": [0, 63, 64, 127],
            "skipped": [True, False, False, False],
            "skipped_count": [5, 0, 0, 0],
            "bucket_width": 64,
        }
    )
    starts, rates = step_figures.skip_rates(series, buckets=2)
    assert starts == [0, 64] and rates == [5 / 64, 0.0]


def test_grad_norm_is_log_with_gaps_for_non_finite(series: StepSeries) -> None:
    figure = step_figures.grad_norm_figure(series)
    assert figure.layout.yaxis.type == "log"
    assert values(figure.data[0].y) == [1.0, 0.9, None, 0.8, None, 0.7]
    assert len(figure.data) == 1  # the loop did not clip: no second trace


def test_grad_norm_after_clipping_is_a_second_trace(steps_json: dict[str, Any]) -> None:
    series = StepSeries.from_json(
        {**steps_json, "grad_norm_clipped": [1.0, 0.9, "NaN", 0.8, None, 0.5]}
    )
    figure = step_figures.grad_norm_figure(series)
    assert [trace.name for trace in figure.data] == [
        "grad norm (unscaled, before clipping)",
        "after clipping",
    ]
    assert values(figure.data[1].y) == [1.0, 0.9, None, 0.8, None, 0.5]


def test_activation_threshold_is_the_collectors_named_and_says_the_rules_conditions(
    series: StepSeries,
) -> None:
    """Replaces the dashboard's own baseline band (a median +- 4 MAD over the plotted
    points, which no alert used): the line is the threshold the rule engine judged."""
    figure = step_figures.activation_norm_figure(series)
    line = trace(figure, step_figures.THRESHOLD_TRACE)
    assert values(line.y) == [None, None, 16.2, 16.0, 16.4, 16.6]
    assert list(line.customdata) == [0, 0, 0, 0, 1, 0]
    for condition in ("max over tokens", "2x the median of the last 128", "z > 10",
                      "warm-up calibration", "before 2 steps"):  # fmt: skip
        assert condition in line.hovertemplate
    maxima = values(trace(figure, "max over tokens").y)
    above = [i for i, t in enumerate(values(line.y)) if t is not None and maxima[i] > t]
    assert above == [4]  # the one point above the line is the step the rule judged above
    assert step_figures.THRESHOLD_TRACE not in [
        t.name for t in step_figures.activation_norm_figure(replace(series, rule_lines=None)).data
    ]


@pytest.mark.parametrize(
    ("stat", "title"),
    [
        ("zero_fraction", "Zero-gradient fraction per layer"),
        ("subnormal_fraction", "FP16-subnormal share per layer"),
        ("flush_fraction", "Flush-to-zero forecast per layer"),
    ],
)
def test_heatmap_names_its_statistic(layers_json: dict[str, Any], stat: str, title: str) -> None:
    figure = heatmap_figures.layer_heatmap(LayerMatrix.from_json({**layers_json, "stat": stat}))
    assert figure.layout.title.text == title
    assert "click a row" in figure.layout.title.subtitle.text


def test_alerts_timeline_draws_each_alert_over_its_steps() -> None:
    alerts = [
        alert(),
        alert(
            id=2,
            rule="skip_rate",
            severity="warning",
            status="resolved",
            started_step=1,
            fired_step=2,
            resolved_step=3,
        ),
        alert(
            id=3,
            rule="underflow_risk",
            layer="head.weight",
            severity="warning",
            status="pending",
            started_step=5,
            fired_step=None,
        ),
    ]
    figure = alert_figures.alerts_timeline_figure(alerts, last_step=10)
    critical = trace(figure, "critical")
    assert list(critical.base) == [3] and list(critical.x) == [7]  # 3 → still firing at 10
    warning = trace(figure, "warning")
    assert list(warning.y) == ["skip_rate", "underflow_risk · head.weight"]
    assert list(warning.base) == [1, 5] and list(warning.x) == [2, 5]
    assert list(warning.marker.opacity) == [0.85, 0.35]  # pending is pale
    assert list(trace(figure, "fired").x) == [4, 2]
    assert critical.customdata[0][1] == "loss scale 0.5 is below min_scale 1"


@pytest.mark.parametrize(
    ("alerts", "text"),
    [
        (None, "This collector has no alert engine."),
        ([], "No alert has fired for this run."),
    ],
)
def test_alerts_timeline_says_why_it_is_empty(alerts: Any, text: str) -> None:
    figure = alert_figures.alerts_timeline_figure(alerts, last_step=10)
    assert figure.layout.annotations[0].text == text and not figure.data


def test_compare_overlays_runs_on_one_step_axis(series: StepSeries) -> None:
    other = StepSeries.from_json(
        {
            "step": [1, 2, 3],
            "loss": [3.0, 2.9, 2.8],
            "loss_scale": [0.5, 0.25, 0.25],
            "act_norm_max": [1, 2, 3],
        }
    )
    figure = compare_figures.compare_figure([("a", series), ("b", other)])
    assert [t.name for t in figure.data] == ["a"] * 3 + ["b"] * 3
    assert [t.showlegend for t in figure.data] == [True, False, False] * 2
    assert [t.yaxis for t in figure.data[:3]] == ["y", "y2", "y3"]
    assert figure.data[0].line.color != figure.data[3].line.color
    assert figure.layout.yaxis2.type == "log" and "2<sup>0</sup>" in figure.layout.yaxis2.ticktext
    assert 10 ** figure.layout.yaxis2.range[0] <= 0.125  # both runs' scales in range
    (one,) = figure.layout.shapes  # `series`'s min_scale; `other` served no rule lines
    assert (one.y0, one.yref) == (1.0, "y2")
    assert series.rule_lines is not None
    strict = replace(series, rule_lines=replace(series.rule_lines, min_scale=8.0))
    both = compare_figures.compare_figure([("a", series), ("c", strict)])
    assert sorted(s.y0 for s in both.layout.shapes) == [1.0, 8.0]  # each run's own line
    assert "Pick two" in compare_figures.compare_figure([]).layout.annotations[0].text
