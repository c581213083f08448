"""The FP8 readiness page: its pure figures and the page itself, drawn from a real
collector's answers for the outlier scenario (`tests/fp8_scenario.py`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from fp8_scenario import SAMPLED, train_outlier_run

from ampwatch.dashboard.app import create_dash_app
from ampwatch.dashboard.client import CollectorClient
from ampwatch.dashboard.fp8_figures import (
    loss_scale_figure,
    readiness_matrix_figure,
    readiness_trend_figure,
    verdict_rows,
)
from ampwatch.dashboard.pages.fp8 import fp8_view


def _text(component: Any) -> str:
    """Every string inside a Dash component tree."""
    if isinstance(component, str):
        return component
    if isinstance(component, (list, tuple)):
        return " ".join(_text(c) for c in component)
    children = getattr(component, "children", None)
    return "" if children is None else _text(children)


def test_the_page_says_which_layer_needs_finer_scaling(
    sqlite_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    with start_collector(sqlite_url, dashboard=False) as live:
        train_outlier_run(live.url)
        client = CollectorClient(live.url)
        run_id = client.list_runs()[0].id
        readiness = client.fp8_readiness(run_id)
        advice = client.loss_scale_advice(run_id)
        page, _ = fp8_view(client, run_id, "/dashboard/run/1")
        app = create_dash_app(f"{live.url}", requests_pathname_prefix="/dashboard/")
        served = {
            path: app.server.test_client()
            .get("/_dash-layout", headers={"Referer": f"http://host/dashboard/run/{run_id}{path}"})
            .get_data(as_text=True)
            .replace("\\u002f", "/")  # Dash's JSON escapes "/"
            for path in ("", "/fp8")
        }
    assert readiness is not None and advice is not None
    # Routed: the run page links to the FP8 page, which draws its verdicts.
    assert f"/dashboard/run/{run_id}/fp8" in served[""]
    assert "needs finer scaling" in served["/fp8"] and "fp8-matrix-graph" in served["/fp8"]

    rows = verdict_rows(readiness)
    assert [(r["layer"], r["verdict"]) for r in rows] == [
        ("2.weight", "needs finer scaling"),
        ("0.weight", "fits (per-tensor FP8)"),
    ]
    assert rows[0]["fits with"] == "tile_1x128, mxfp8"
    text = _text(page)
    assert "1 fits (per-tensor FP8), 1 needs finer scaling, 0 keep in BF16" in text
    assert "Declared recipe: per_tensor." in text and "not FP16" in text

    matrix = readiness_matrix_figure(readiness)
    heat = matrix.data[0]
    assert list(heat.y) == ["2.weight", "0.weight"]
    assert heat.x[0] == "<b>per_tensor</b> (declared)"
    assert heat.text[0][0] == "✗" and list(heat.text[1]) == ["✓"] * 4
    score = readiness["layers"][0]["recipes"]["per_tensor"]["score"]  # ~99x the flush limit
    assert heat.z[0][0] == math.log10(score) and heat.z[0][0] > 1.9
    assert "weight E4M3 tensor: flush 9" in heat.customdata[0][0]

    trend = readiness_trend_figure(readiness)
    assert [t.name for t in trend.data] == ["2.weight", "0.weight"]
    assert list(trend.data[0].x) == SAMPLED and min(trend.data[0].y) > 1
    assert max(trend.data[1].y) <= 1

    # FP32 run: the advice has a table nonetheless (the histograms are there).
    assert len(loss_scale_figure(advice).data) == 2


def test_figures_say_why_they_are_empty() -> None:
    empty = {"layers": [], "recipes": {}, "steps": [], "step": None}
    assert "No FP8 samples yet" in readiness_matrix_figure(empty).layout.annotations[0].text
    assert "No FP8 samples yet" in readiness_trend_figure(empty).layout.annotations[0].text
    advice = {"table": [], "reason": "no exponent histograms yet"}
    assert loss_scale_figure(advice).layout.annotations[0].text == "no exponent histograms yet"
