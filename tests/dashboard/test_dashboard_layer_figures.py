"""The layer page's figures: exponent histograms against the formats' ranges, and series."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from ampwatch.agent.wire import EXPONENT_BIAS
from ampwatch.dashboard import layer_figures
from ampwatch.dashboard.series_types import LayerHistograms, LayerSeries

# Field f holds |g| in [2^(f-127), 2^(f-126)): offset 100 is |g| ~ 2^-27.
HISTS = LayerHistograms(
    layer="head.weight",
    steps=[10, 20, 30],
    offsets=[0, 100, 100],
    counts=[[2, 0, 0], [0, 6, 2], [1, 2, 1]],
)


def values(array: Any) -> list[Any]:
    """A trace's values as a list, NaN (a gap in plotly.js) as None."""
    return [None if isinstance(v, float) and math.isnan(v) else v for v in list(array)]


def test_formats_match_their_specifications() -> None:
    formats = {f.name: f for f in layer_figures.FORMATS}
    assert (formats["FP16"].min_subnormal, formats["FP16"].min_normal) == (-24, -14)
    assert 2 ** formats["FP16"].max == pytest.approx(65504)
    assert (formats["FP8 E4M3"].min_subnormal, 2 ** formats["FP8 E4M3"].max) == (
        -9,
        pytest.approx(448),
    )
    assert (formats["FP8 E5M2"].min_subnormal, 2 ** formats["FP8 E5M2"].max) == (
        -16,
        pytest.approx(57344),
    )
    assert (formats["BF16"].min_subnormal, formats["BF16"].min_normal) == (-133, -126)


def test_bins_are_scaled_gradient_exponents() -> None:
    """At scale S = 2^10 a bin of field f sits at log2|g·S| = f - 127 + 10 (its centre +0.5)."""
    figure = layer_figures.exponent_histogram_figure(HISTS, [1.0, 2.0**10, 2.0**10], active=1)
    bars = figure.data[0]
    assert list(bars.x) == [101 - EXPONENT_BIAS + 10 + 0.5, 102 - EXPONENT_BIAS + 10 + 0.5]
    assert list(bars.y) == [0.75, 0.25]  # shares of all elements
    assert "step 20" in figure.layout.title.text
    assert "1024 (2^10)" in figure.layout.title.subtitle.text


def test_zeros_and_non_finite_are_reported_not_drawn() -> None:
    hists = LayerHistograms("w", [1], [0], [[4] + [0] * 100 + [4] + [0] * 153 + [2]])
    figure = layer_figures.exponent_histogram_figure(hists, [None])
    assert list(figure.data[0].x) == [101 - EXPONENT_BIAS + 0.5]  # no scaler: S = 1
    subtitle = figure.layout.title.subtitle.text
    assert "exactly zero (or float32 subnormal): 40.0%" in subtitle
    assert "Inf/NaN: 20.0%" in subtitle


def test_one_animation_frame_per_step_with_a_slider_and_play_button() -> None:
    figure = layer_figures.exponent_histogram_figure(HISTS, [1.0, 1.0, 4.0])
    assert [f.name for f in figure.frames] == ["10", "20", "30"]
    assert [list(f.data[0].x) for f in figure.frames][2] == [
        f - EXPONENT_BIAS + 2 + 0.5 for f in (100, 101, 102)
    ]
    (slider,) = figure.layout.sliders
    assert slider.active == 2  # the latest step first
    assert [list(s.args[0]) for s in slider.steps] == [["10"], ["20"], ["30"]]
    labels = [b.label for b in figure.layout.updatemenus[0].buttons]
    assert "▶ play" in labels
    json.loads(figure.to_json(), parse_constant=lambda name: pytest.fail(name))


def test_ranges_are_drawn_under_the_histogram() -> None:
    figure = layer_figures.exponent_histogram_figure(HISTS, [1.0, 1.0, 1.0])
    ruler = {t.name: t for t in figure.data[1:]}
    normal = ruler["normal range"]
    i = list(normal.y).index("FP16")
    assert normal.base[i] == -14 and normal.base[i] + normal.x[i] == pytest.approx(math.log2(65504))
    subnormal = ruler["subnormal range"]
    assert subnormal.base[i] == -24 and subnormal.x[i] == 10
    zones = [(s.x0, s.x1) for s in figure.layout.shapes]
    assert (-24, -14) in zones  # FP16 subnormal, shaded on the histogram
    labels = [a.text for a in figure.layout.annotations]
    assert "flushes to 0 in FP16" in labels and "overflows FP16" in labels
    low, high = figure.layout.xaxis.range
    assert low < -24 - 2 and high > math.log2(65504)  # FP16's whole range always shows


def test_empty_histograms_say_so() -> None:
    figure = layer_figures.exponent_histogram_figure(LayerHistograms("w", [], [], []), [])
    assert "No exponent histograms" in figure.layout.annotations[0].text


def test_layer_series_has_the_shares_and_the_overflow_ceiling() -> None:
    def series(stat: str, value: list[float | None]) -> LayerSeries:
        return LayerSeries("w", stat, [10, 20], value)

    figure = layer_figures.layer_series_figure(
        {
            "zero_fraction": series("zero_fraction", [0.0, 1.0]),
            "flush_fraction": series("flush_fraction", [0.1, math.nan]),
        },
        series("max_abs_scaled", [100.0, 0.0]),
    )
    names = [t.name for t in figure.data]
    assert names[0] == "exactly zero" and names[-1] == "max |g·S|"
    assert values(figure.data[1].y) == [0.1, None]
    assert values(figure.data[-1].y) == [100.0, None]  # 0 cannot sit on a log axis
    assert [s.y0 for s in figure.layout.shapes] == [65504.0]
