from __future__ import annotations

import json
import math
from typing import Any

import plotly.graph_objects as go
import pytest

from ampwatch.dashboard import figures
from ampwatch.dashboard.client import LayerMatrix, StepSeries


def trace(figure: go.Figure, name: str) -> Any:
    (match,) = [t for t in figure.data if t.name == name]
    return match


@pytest.fixture
def series(steps_json: dict[str, Any]) -> StepSeries:
    return StepSeries.from_json(steps_json)


def test_loss_scale_axis_is_log_with_power_of_two_ticks(series: StepSeries) -> None:
    figure = figures.loss_scale_figure(series)
    yaxis = figure.layout.yaxis
    assert yaxis.type == "log"
    assert yaxis.title.text == "loss scale (log2)"
    assert all(math.log2(v).is_integer() for v in yaxis.tickvals)
    assert "2<sup>16</sup>" in yaxis.ticktext
    # The range always reaches below 1.0, so the healthy line is visible at 2^16 too.
    low, high = yaxis.range
    assert 10**low < 1.0 and 10**high > 65536.0


def test_loss_scale_has_dashed_line_at_one(series: StepSeries) -> None:
    figure = figures.loss_scale_figure(series)
    lines = [s for s in figure.layout.shapes if s.y0 == 1.0 and s.y1 == 1.0]
    assert len(lines) == 1
    assert lines[0].line.dash == "dash"
    assert lines[0].yref == "y"  # on the loss-scale row, not the loss row


def test_run_without_scaler_says_so_instead_of_empty_axes(steps_json: dict[str, Any]) -> None:
    no_scaler = StepSeries.from_json({**steps_json,
                                      "loss_scale": [None] * len(steps_json["step"])})
    texts = [a.text for a in figures.loss_scale_figure(no_scaler).layout.annotations]
    assert figures.NO_SCALER_MESSAGE in texts
    texts = [a.text for a in figures.loss_scale_figure(StepSeries.from_json(steps_json))
             .layout.annotations]
    assert figures.NO_SCALER_MESSAGE not in texts


def test_skipped_markers_sit_at_exactly_the_skipped_steps(series: StepSeries) -> None:
    skipped = trace(figures.loss_scale_figure(series), "skipped step (2)")
    assert list(skipped.x) == [3, 5]
    assert list(skipped.y) == [65536.0, 32768.0]
    assert skipped.mode == "markers" and skipped.marker.symbol == "x"
    assert skipped.name == "skipped step (2)"


def test_non_finite_loss_is_a_gap_and_a_marker(series: StepSeries) -> None:
    figure = figures.loss_scale_figure(series)
    loss = trace(figure, "loss")
    assert list(loss.y) == [2.5, 2.4, None, 2.2, None, 2.0]
    assert loss.yaxis == "y2"
    marked = trace(figure, "non-finite loss")
    assert list(marked.x) == [3, 5]
    assert list(marked.customdata) == ["inf", "nan"]
    assert list(marked.y) == [2.5, 2.5]  # on the top edge of the finite losses


def test_no_non_finite_marker_trace_when_every_loss_is_finite() -> None:
    series = StepSeries.from_json({"step": [1, 2], "loss": [1.0, 0.9], "loss_scale": [2.0, 2.0]})
    names = [t.name for t in figures.loss_scale_figure(series).data]
    assert names == ["loss scale", "skipped step (0)", "loss"]


def test_non_positive_or_non_finite_scale_is_a_gap_not_a_log_error() -> None:
    series = StepSeries.from_json(
        {"step": [1, 2, 3], "loss_scale": [4.0, "NaN", 0.0], "skipped": [False, True, True]}
    )
    figure = figures.loss_scale_figure(series)
    assert list(trace(figure, "loss scale").y) == [4.0, None, None]
    # Skips whose scale is unknown still show, on the axis floor.
    low = 10 ** figure.layout.yaxis.range[0]
    assert list(trace(figure, "skipped step (2)").y) == pytest.approx([low, low])


def test_checkpoints_are_vertical_lines(series: StepSeries) -> None:
    figure = figures.loss_scale_figure(series, checkpoint_steps=[4])
    verticals = [s for s in figure.layout.shapes if s.x0 == 4 and s.x1 == 4]
    assert len(verticals) == 1 and verticals[0].line.dash == "dot"
    assert [a.text for a in figure.layout.annotations] == ["ckpt"]


def test_activation_norm_has_mean_and_max_with_gaps(series: StepSeries) -> None:
    figure = figures.activation_norm_figure(series)
    assert list(trace(figure, "mean over tokens").y) == [7.9, 8.0, 8.1, None, 8.3, 8.4]
    assert list(trace(figure, "max over tokens").y) == [11.2, 11.0, 12.5, 13.0, 40.0, 12.0]
    assert figure.layout.yaxis.title.text == "activation L2 norm"


def test_heatmap_is_layers_by_steps_and_carries_values(layers_json: dict[str, Any]) -> None:
    figure = figures.zero_fraction_heatmap(LayerMatrix.from_json(layers_json))
    (heatmap,) = figure.data
    assert list(heatmap.y) == ["embed.weight", "blocks.0.mlp.fc1.weight", "head.weight"]
    assert list(heatmap.x) == [2, 4, 6]
    z = [list(row) for row in heatmap.z]
    assert len(z) == 3 and all(len(row) == 3 for row in z)
    assert z[0] == [0.01, 0.02, 0.03]  # layer 0 across steps: the API's rows transposed
    assert z[1] == [0.1, None, 0.3]  # NaN is an empty cell
    assert z[2] == [1.0, 1.0, 1.0]
    assert (heatmap.zmin, heatmap.zmax) == (0.0, 1.0)
    assert heatmap.colorscale[-1] == (1.0, figures.FROZEN_COLOR)  # frozen stands out
    assert figure.layout.yaxis.autorange == "reversed"  # first layer on top


def test_heatmap_tolerates_short_rows() -> None:
    matrix = LayerMatrix.from_json(
        {
            "stat": "zero_fraction",
            "layers": ["a", "b"],
            "steps": [1, 2],
            "values": [[0.5], [0.1, 0.2]],
        }
    )
    (heatmap,) = figures.zero_fraction_heatmap(matrix).data
    assert [list(row) for row in heatmap.z] == [[0.5, 0.1], [None, 0.2]]


@pytest.mark.parametrize(
    "figure",
    [
        figures.loss_scale_figure(StepSeries.from_json({})),
        figures.activation_norm_figure(StepSeries.from_json({"step": [1], "loss": [1.0]})),
        figures.zero_fraction_heatmap(LayerMatrix.from_json({"stat": "zero_fraction"})),
    ],
)
def test_missing_data_explains_itself(figure: go.Figure) -> None:
    assert len(figure.data) == 0
    assert "No " in figure.layout.annotations[0].text


def test_refreshes_keep_the_users_zoom(series: StepSeries, layers_json: dict[str, Any]) -> None:
    for figure in (
        figures.loss_scale_figure(series),
        figures.activation_norm_figure(series),
        figures.zero_fraction_heatmap(LayerMatrix.from_json(layers_json)),
    ):
        assert figure.layout.uirevision == figures.UI_REVISION


def test_figures_serialise_without_bare_nan(
    series: StepSeries, layers_json: dict[str, Any]
) -> None:
    """Browsers reject NaN in JSON; every figure must be strict JSON."""
    for figure in (
        figures.loss_scale_figure(series),
        figures.activation_norm_figure(series),
        figures.zero_fraction_heatmap(LayerMatrix.from_json(layers_json)),
    ):
        json.loads(figure.to_json(), parse_constant=lambda name: pytest.fail(name))


def test_log2_ticks_thin_out_over_a_wide_range() -> None:
    values, labels = figures.log2_ticks(2.0**-10, 2.0**32)
    assert len(values) <= figures.MAX_LOG2_TICKS
    assert 2.0**-10 <= values[0] and values[-1] <= 2.0**32
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
    assert figures.format_loss_scale(value) == text


def test_format_time_is_utc_to_the_second() -> None:
    assert figures.format_time("2026-11-29T10:30:05.5+01:00") == "2026-11-29 09:30:05 UTC"
    assert figures.format_time("yesterday") == "yesterday"
