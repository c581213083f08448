"""The app through its real HTTP surface (Flask test client, and mounted in FastAPI)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import dash
import httpx
import pytest
from a2wsgi import WSGIMiddleware
from fastapi import FastAPI

from ampwatch.dashboard import ids
from ampwatch.dashboard.app import create_dash_app
from ampwatch.dashboard.client import CollectorClient
from ampwatch.dashboard.pages import runs
from ampwatch.dashboard.pages.run import render_run
from ampwatch.dashboard.pages.run_panels import hidden_note
from ampwatch.dashboard.pages.run_store import (
    cursor_of,
    fetch_run_data,
    select_alerts,
    update_run_data,
    zoom_window,
)
from ampwatch.dashboard.run_types import Alert, RunSummary
from ampwatch.dashboard.series_types import StepSeries

MakeTransport = Callable[..., httpx.MockTransport]
RUN_ID = 7  # the run the `collector_transport` fixture serves


def call_callback(
    app: dash.Dash,
    output: tuple[str, str],
    inputs: list[tuple[str, str, Any]],
    state: list[tuple[str, str, Any]] = [],  # noqa: B006 - never mutated
    changed: int | None = None,
) -> Any:
    """POST one callback the way the Dash renderer does and return the output's value
    (None when the callback answered "no update"). `changed`: the index of the input that
    triggered it (default: all of them)."""
    triggered = inputs if changed is None else [inputs[changed]]
    body = {
        "output": f"{output[0]}.{output[1]}",
        "outputs": {"id": output[0], "property": output[1]},
        "inputs": [{"id": i, "property": p, "value": v} for i, p, v in inputs],
        "changedPropIds": [f"{i}.{p}" for i, p, _ in triggered],
        "state": [{"id": i, "property": p, "value": v} for i, p, v in state],
    }
    response = app.server.test_client().post("/_dash-update-component", json=body)
    if response.status_code == 204:
        return None
    assert response.status_code == 200, response.get_data(as_text=True)
    return json.loads(response.get_data(as_text=True))["response"][output[0]][output[1]]


def routed_page(app: dash.Dash, pathname: str, search: str = "") -> str:
    return json.dumps(
        call_callback(
            app,
            (ids.PAGE, "children"),
            [(ids.ROUTE, "data", {"pathname": pathname, "search": search})],
        )
    )


def make_app(transport: httpx.MockTransport, prefix: str = "/dashboard/") -> dash.Dash:
    return create_dash_app(
        "http://collector.test", requests_pathname_prefix=prefix, transport=transport
    )


def test_router_strips_the_mount_prefix(collector_transport: MakeTransport) -> None:
    app = make_app(collector_transport())
    assert ids.RUNS_TABLE in routed_page(app, "/dashboard/")
    run_page = routed_page(app, "/dashboard/run/7")
    assert ids.HEATMAP_GRAPH in run_page and '"data": 7' in run_page
    layer_page = routed_page(app, "/dashboard/run/7/layer/blocks.0%2Fodd.weight", "?step=40")
    assert ids.LAYER_HISTOGRAM_GRAPH in layer_page
    assert '"layer": "blocks.0/odd.weight"' in layer_page and '"step": 40' in layer_page
    compare = routed_page(app, "/dashboard/compare", "?runs=7,8")  # run 8 is unknown
    assert ids.COMPARE_GRAPH in compare and '"value": [7]' in compare
    assert "Page not found" in routed_page(app, "/dashboard/run/abc")


def test_run_page_arrives_drawn_with_its_data(collector_transport: MakeTransport) -> None:
    """The router's answer carries the figures: no fetch/render round trip before a chart."""
    page = json.loads(routed_page(make_app(collector_transport()), "/dashboard/run/7"))
    text = json.dumps(page)
    assert '"name": "loss scale"' in text and '"type": "heatmap"' in text
    assert "restart here" in text and "loss_scale_collapse" in text
    assert "Loading" not in text


def initial_layout(app: dash.Dash, referrer: str | None) -> dict[str, Any]:
    """`_dash-layout` as the browser asks for it: from the page, with its URL as Referer."""
    headers = {"Referer": referrer} if referrer else {}
    response = app.server.test_client().get("/_dash-layout", headers=headers)
    assert response.status_code == 200, response.get_data(as_text=True)
    # It varies with the Referer and holds live data: no cache may keep it.
    assert (response.headers["Vary"], response.headers["Cache-Control"]) == ("Referer", "no-store")
    layout: dict[str, Any] = json.loads(response.get_data(as_text=True))
    return layout


def drawn_and_page(layout: dict[str, Any]) -> tuple[str | None, Any]:
    """The initial layout's record of the URL it drew, and the page it holds."""
    children = {
        child["props"]["id"]: child["props"]
        for child in layout["props"]["children"]
        if "id" in child["props"]
    }
    assert set(children) == {ids.URL, ids.PAGE_DRAWN, ids.ROUTE, ids.PAGE}
    assert children[ids.URL] == {"id": ids.URL, "refresh": "callback-nav"}  # reads the URL
    return children[ids.PAGE_DRAWN].get("data"), children[ids.PAGE].get("children")


def test_a_visit_by_url_gets_its_page_inside_the_initial_layout(
    collector_transport: MakeTransport,
) -> None:
    """No router round trip for the first render: the page is in `_dash-layout`, with the
    URL it was drawn for, which the browser checks against its own (`ROUTE_GUARD`)."""
    app = make_app(collector_transport())
    drawn, page = drawn_and_page(initial_layout(app, "http://dash.test/dashboard/run/7"))
    assert drawn == "/dashboard/run/7"
    text = json.dumps(page)
    assert '"name": "loss scale"' in text and '"type": "heatmap"' in text
    assert "Loading" not in text

    drawn, page = drawn_and_page(
        initial_layout(app, "http://dash.test/dashboard/run/7/layer/head.weight?step=40")
    )
    assert drawn == "/dashboard/run/7/layer/head.weight?step=40"
    assert '"layer": "head.weight"' in json.dumps(page) and '"step": 40' in json.dumps(page)
    dependencies = app.server.test_client().get("/_dash-dependencies").get_json()
    (guard,) = [
        d for d in dependencies if d["output"] == f"..{ids.ROUTE}.data...{ids.PAGE_DRAWN}.data.."
    ]
    assert guard["prevent_initial_call"] is True  # only the Location's reading of the URL
    assert [i["id"] for i in guard["inputs"]] == [ids.URL]
    (route,) = [d for d in dependencies if d["output"] == f"{ids.PAGE}.children"]
    assert [i["id"] for i in route["inputs"]] == [ids.ROUTE]


def test_without_a_referrer_of_the_app_the_router_draws_the_page(
    collector_transport: MakeTransport,
) -> None:
    """A proxy that strips Referer, or one from elsewhere: an empty frame, which the
    router fills once the Location has read the URL."""
    for referrer in (None, "http://elsewhere.test/other/run/7"):
        drawn, page = drawn_and_page(initial_layout(make_app(collector_transport()), referrer))
        assert drawn is None and page is None


def test_only_the_layout_request_draws_a_page(collector_transport: MakeTransport) -> None:
    """Dash calls the layout function in the first request it serves, whatever it is: an
    HTML page with a Referer must not draw (and read the collector for) another page."""
    transport = collector_transport()
    app = make_app(transport)
    client = app.server.test_client()
    before = len(transport.requests)  # type: ignore[attr-defined]
    assert (
        client.get("/", headers={"Referer": "http://dash.test/dashboard/run/7"}).status_code == 200
    )
    assert len(transport.requests) == before  # type: ignore[attr-defined]


def test_a_page_that_fails_to_draw_leaves_the_layout_to_the_router(
    collector_transport: MakeTransport,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(**_kwargs: Any) -> None:
        raise ZeroDivisionError("a bug in a page")

    app = make_app(collector_transport())
    monkeypatch.setattr(runs, "layout", broken)
    drawn, page = drawn_and_page(initial_layout(app, "http://dash.test/dashboard/"))
    assert drawn is None and page is None  # the app still loads
    assert "the router will draw it" in caplog.text and "a bug in a page" in caplog.text


def runs_table(
    app: dash.Dash,
    runs_json: list[dict[str, Any]],
    text: str = "",
    health: str = "any",
    status: str = "any",
    sort: dict[str, Any] | None = None,
) -> str:
    return json.dumps(
        call_callback(
            app,
            (ids.RUNS_TABLE, "children"),
            [
                (ids.RUNS_DATA, "data", {"runs": runs_json}),
                (ids.RUNS_FILTER_TEXT, "value", text),
                (ids.RUNS_FILTER_HEALTH, "value", health),
                (ids.RUNS_FILTER_STATUS, "value", status),
                (ids.RUNS_SORT, "data", sort or runs.DEFAULT_SORT),
            ],
        )
    )


def test_runs_table_links_to_run_pages_under_the_prefix(
    collector_transport: MakeTransport, run_json: dict[str, Any]
) -> None:
    app = make_app(collector_transport())
    data = call_callback(app, (ids.RUNS_DATA, "data"), [(ids.RUNS_REFRESH, "n_intervals", 0)])
    assert data["runs"][0]["name"] == "gpt-small"
    table = runs_table(app, data["runs"])
    assert '"href": "/dashboard/run/7"' in table
    assert "gpt-small" in table and "16384 (2^14)" in table


def test_runs_overview_shows_health_skip_rate_and_age(run_json: dict[str, Any]) -> None:
    run = RunSummary.from_json({**run_json, "health": "critical", "skip_rate": 0.125})
    now = datetime(2026, 11, 29, 9, 35, 5, tzinfo=timezone.utc)
    (row,) = runs.runs_rows([run], lambda run_id: f"/run/{run_id}", now=now)
    cells = json.dumps(row.to_plotly_json(), default=lambda c: c.to_plotly_json())
    assert "health-critical" in cells and "12.5%" in cells and "4 min ago" in cells


def test_runs_filter_and_sort(run_json: dict[str, Any]) -> None:
    def run(i: int, name: str, health: str, status: str, rate: float | None) -> RunSummary:
        return RunSummary.from_json(
            {
                **run_json,
                "id": i,
                "name": name,
                "health": health,
                "status": status,
                "skip_rate": rate,
            }
        )

    all_runs = [
        run(1, "bert", "ok", "ended", 0.0),
        run(2, "gpt-a", "critical", "running", 0.5),
        run(3, "gpt-b", "warning", "running", None),
    ]

    def names(**kwargs: Any) -> list[str]:
        return [r.name for r in runs.select_runs(all_runs, **kwargs)]

    assert names() == ["gpt-a", "gpt-b", "bert"]  # default: worst health first
    assert names(text="GPT") == ["gpt-a", "gpt-b"]
    assert names(health="warning") == ["gpt-b"]
    assert names(status="ended") == ["bert"]
    assert names(sort={"column": "skip_rate", "descending": False}) == ["bert", "gpt-a", "gpt-b"]
    assert names(sort={"column": "skip_rate", "descending": True}) == ["gpt-a", "bert", "gpt-b"]
    assert names(sort={"column": "name", "descending": False}) == ["bert", "gpt-a", "gpt-b"]


def test_clicking_a_header_sorts_by_it_then_reverses(collector_transport: MakeTransport) -> None:
    app = make_app(collector_transport())
    header = {"type": ids.RUNS_SORT_HEADER, "column": "last_step"}
    body = {
        "output": f"{ids.RUNS_SORT}.data",
        "outputs": {"id": ids.RUNS_SORT, "property": "data"},
        "inputs": [[{"id": header, "property": "n_clicks", "value": 1}]],
        "changedPropIds": [json.dumps(header, separators=(",", ":"), sort_keys=True) + ".n_clicks"],
        "state": [{"id": ids.RUNS_SORT, "property": "data", "value": runs.DEFAULT_SORT}],
    }
    response = app.server.test_client().post("/_dash-update-component", json=body)
    assert response.status_code == 200, response.get_data(as_text=True)
    sort = json.loads(response.get_data(as_text=True))["response"][ids.RUNS_SORT]["data"]
    assert sort == {"column": "last_step", "descending": True}


def test_fetch_keeps_nan_apart_from_null_in_the_store(
    collector_transport: MakeTransport,
) -> None:
    client = CollectorClient("http://collector.test", transport=collector_transport())
    data = fetch_run_data(client, RUN_ID)
    assert data["steps"]["loss"] == [2.5, 2.4, "Infinity", 2.2, "NaN", 2.0]
    assert data["steps"]["grad_norm"][2] is None
    assert math.isnan(StepSeries.from_json(data["steps"]).loss[4])  # type: ignore[arg-type]
    view = render_run(data)
    loss_scale, _skip_rate, _grad_norm, activation, heatmap, _alerts = view[1:7]
    # Loss scale: scale, skips, loss, non-finite loss and the min_scale line (a trace now,
    # named; it was an unnamed shape); activation: max, mean and the rule's threshold (the
    # band's two traces are gone).
    assert [len(f.data) for f in (loss_scale, activation, heatmap)] == [5, 3, 1]
    assert view[-1] == {}


def grown(run_json: dict[str, Any], last_step: int) -> dict[str, Any]:
    """The run summary once more steps have arrived."""
    return {**run_json, "last_step": last_step, "last_seen_at": "2026-11-29T09:31:00+00:00"}


def stored_cursor(
    transport: httpx.MockTransport, run_json: dict[str, Any]
) -> tuple[CollectorClient, dict[str, Any]]:
    """A client of `transport` and the cursor of the page as first drawn, when the run
    summary was still `run_json` (so the next refresh sees it moved)."""
    client = CollectorClient("http://collector.test", transport=transport)
    stored = fetch_run_data(client, RUN_ID)
    stored["run"] = {**stored["run"], "last_seen_at": run_json["last_seen_at"]}
    cursor = cursor_of(stored)
    assert cursor is not None
    return client, cursor


def test_live_refresh_fetches_only_new_steps_and_appends_them(
    collector_transport: MakeTransport,
    run_json: dict[str, Any],
    steps_json: dict[str, Any],
) -> None:
    run = f"/api/v1/runs/{RUN_ID}"

    def steps_after(request: httpx.Request) -> dict[str, Any]:
        if "start" in request.url.params:  # the incremental read: steps 7 and 8 only
            assert request.url.params["start"] == "7"
            return {
                "step": [7, 8],
                "loss": [1.9, "NaN"],
                "loss_scale": [16384.0, 8192.0],
                "skipped": [False, True],
                "skipped_count": [0, 1],
                "bucket_width": 1,
            }
        return steps_json

    transport = collector_transport(**{run: grown(run_json, 8), f"{run}/steps": steps_after})
    client, cursor = stored_cursor(transport, run_json)
    assert (cursor["last_step"], cursor["heatmap_next"]) == (6, 7)
    patch, moved = update_run_data(client, RUN_ID, cursor, "zero_fraction")
    operations = patch.to_plotly_json()["operations"]
    extended = {
        tuple(op["location"]): op["params"]["value"]
        for op in operations
        if op["operation"] == "Extend"
    }
    assert extended[("steps", "step")] == [7, 8]
    assert extended[("steps", "loss")] == [1.9, "NaN"]
    assert extended[("steps", "skipped_count")] == [0, 1]
    requests: list[httpx.Request] = transport.requests  # type: ignore[attr-defined]
    step_reads = [r for r in requests if r.url.path == f"{run}/steps"]
    assert [r.url.params.get("start") for r in step_reads] == [None, "7"]
    row_reads = [
        r
        for r in requests
        if r.url.path == f"{run}/layers" and r.url.params.get("stat") == "zero_fraction"
    ]
    # Heatmap rows after the last stored row's bucket (rows at 2, 4, 6; one step each).
    assert [r.url.params.get("start") for r in row_reads] == [None, "7"]

    assert (moved["last_step"], moved["points"], moved["rows"]) == (8, 8, 6)
    assert moved["run"]["last_step"] == 8
    assert update_run_data(client, RUN_ID, moved, "zero_fraction") == (
        dash.no_update,
        dash.no_update,
    )


def test_new_rows_in_wider_buckets_than_the_stored_replace_the_heatmap(
    collector_transport: MakeTransport,
    run_json: dict[str, Any],
    layers_json: dict[str, Any],
) -> None:
    """A long backlog comes downsampled wider than the stored buckets: appended, it would
    leave empty columns between them, so the whole matrix is read again instead."""
    run = f"/api/v1/runs/{RUN_ID}"
    whole = {**layers_json, "steps": [2, 30, 60], "step_width": 4}

    def rows(request: httpx.Request) -> dict[str, Any]:
        if "start" in request.url.params:  # the tail: 250 rows in buckets of 8 steps
            return {**layers_json, "steps": [64, 72, 80], "step_width": 8}
        return whole

    transport = collector_transport(**{run: grown(run_json, 80), f"{run}/layers": rows})
    client, cursor = stored_cursor(transport, run_json)
    assert cursor["heatmap_width"] == 4
    patch, moved = update_run_data(client, RUN_ID, cursor, "zero_fraction")
    replaced = {
        tuple(op["location"]): op["params"]["value"]
        for op in patch.to_plotly_json()["operations"]
        if op["operation"] == "Assign"
    }
    assert replaced[("heatmap",)]["steps"] == [2, 30, 60]  # the whole matrix, re-read
    assert (moved["rows"], moved["heatmap_width"]) == (3, 4)


@pytest.mark.parametrize(
    ("relayout", "window"),
    [
        ({"xaxis.range[0]": 10.4, "xaxis.range[1]": 99.6}, (10, 100)),
        ({"xaxis2.range": [50, 20]}, (20, 50)),
        ({"xaxis.autorange": True, "yaxis.autorange": True}, None),
        ({"autosize": True}, False),
        ({"yaxis.range[0]": 1, "yaxis.range[1]": 2}, False),
        (None, False),
    ],
)
def test_zoom_window_reads_the_x_range(relayout: Any, window: Any) -> None:
    assert zoom_window(relayout) == window


def test_zooming_refetches_the_window_at_finer_resolution(
    collector_transport: MakeTransport,
    steps_json: dict[str, Any],
) -> None:
    transport = collector_transport()
    app = make_app(transport)
    graphs = [(graph, "relayoutData", None) for graph in ids.ZOOMABLE_GRAPHS]
    graphs[0] = (
        ids.LOSS_SCALE_GRAPH,
        "relayoutData",
        {"xaxis.range[0]": 2.2, "xaxis.range[1]": 4.9},
    )
    inputs = [*graphs, (ids.HEATMAP_STAT, "value", "zero_fraction")]
    state = [(ids.RUN_ID, "data", RUN_ID), (ids.RUN_ZOOM, "data", None)]
    zoom = call_callback(app, (ids.RUN_ZOOM, "data"), inputs, state, changed=0)
    assert (zoom["start"], zoom["end"]) == (2, 5)
    (read,) = [
        r
        for r in transport.requests  # type: ignore[attr-defined]
        if r.url.path.endswith("/steps")
    ]
    assert dict(read.url.params) == {"rank": "0", "start": "2", "end": "5", "max_points": "2000"}
    view = render_run(
        fetch_run_data(
            CollectorClient("http://collector.test", transport=collector_transport()), RUN_ID
        ),
        zoom,
    )
    assert tuple(view[1].layout.xaxis.range) == (2, 5)

    graphs[0] = (ids.LOSS_SCALE_GRAPH, "relayoutData", {"xaxis.autorange": True})
    assert (
        call_callback(app, (ids.RUN_ZOOM, "data"), [*graphs, inputs[-1]], state, changed=0) is None
    )


def test_alerts_and_restart_advice_render_with_explanations(
    collector_transport: MakeTransport,
) -> None:
    client = CollectorClient("http://collector.test", transport=collector_transport())
    view = render_run(fetch_run_data(client, RUN_ID))
    alerts_list = json.dumps(view[7].to_plotly_json(), default=lambda c: c.to_plotly_json())
    assert "loss scale 0.5 is below min_scale 1" in alerts_list
    assert "min_scale = 1.0" in alerts_list and "firing" in alerts_list
    table = json.dumps(view[8].to_plotly_json(), default=lambda c: c.to_plotly_json())
    assert "Restart from step 4." in table and "candidate-recommended" in table
    assert "loss scale 0.5 < 1" in table
    assert "restart here" in [a.text for a in view[1].layout.annotations]


def test_without_alert_engine_or_advisor_the_page_says_so(
    collector_transport: MakeTransport,
) -> None:
    run = f"/api/v1/runs/{RUN_ID}"
    transport = collector_transport(missing=(f"{run}/alerts", f"{run}/restart-candidates"))
    view = render_run(
        fetch_run_data(CollectorClient("http://collector.test", transport=transport), RUN_ID)
    )
    assert view[6].layout.annotations[0].text == "This collector has no alert engine."
    text = json.dumps(
        [view[7].to_plotly_json(), view[8].to_plotly_json()], default=lambda c: c.to_plotly_json()
    )
    assert "not available on this collector" in text
    assert "/ckpt/4.pt" in text  # the agent's checkpoints still listed
    assert "ckpt" in [a.text for a in view[1].layout.annotations]


def test_heatmap_click_and_layer_pick_open_the_layer_page(
    collector_transport: MakeTransport,
) -> None:
    app = make_app(collector_transport())
    click = {"points": [{"x": 40, "y": "blocks.0/odd.weight", "z": 1.0}]}
    inputs = [(ids.HEATMAP_GRAPH, "clickData", click), (ids.RUN_LAYER_PICK, "value", None)]
    href = call_callback(app, (ids.URL, "href"), inputs, [(ids.RUN_ID, "data", RUN_ID)], changed=0)
    assert href == "/dashboard/run/7/layer/blocks.0%2Fodd.weight?step=40"
    inputs = [(ids.HEATMAP_GRAPH, "clickData", None), (ids.RUN_LAYER_PICK, "value", "head.weight")]
    assert (
        call_callback(app, (ids.URL, "href"), inputs, [(ids.RUN_ID, "data", RUN_ID)], changed=1)
        == "/dashboard/run/7/layer/head.weight"
    )


def test_layer_page_draws_series_and_histograms(collector_transport: MakeTransport) -> None:
    app = make_app(collector_transport())
    key = {"run_id": RUN_ID, "layer": "head.weight", "step": 4}
    body = {
        "output": "..layer-header.children...layer-histogram-graph.figure..."
        "layer-series-graph.figure...layer-pick.options..",
        "outputs": [
            {"id": i, "property": p}
            for i, p in (
                (ids.LAYER_HEADER, "children"),
                (ids.LAYER_HISTOGRAM_GRAPH, "figure"),
                (ids.LAYER_SERIES_GRAPH, "figure"),
                (ids.LAYER_PICK, "options"),
            )
        ],
        "inputs": [{"id": ids.LAYER_KEY, "property": "data", "value": key}],
        "changedPropIds": [f"{ids.LAYER_KEY}.data"],
        "state": [],
    }
    response = app.server.test_client().post("/_dash-update-component", json=body)
    assert response.status_code == 200, response.get_data(as_text=True)
    answer = json.loads(response.get_data(as_text=True))["response"]
    histogram = answer[ids.LAYER_HISTOGRAM_GRAPH]["figure"]
    assert [f["name"] for f in histogram["frames"]] == ["2", "4", "6"]
    assert histogram["layout"]["sliders"][0]["active"] == 1  # ?step=4
    series = answer[ids.LAYER_SERIES_GRAPH]["figure"]
    assert series["data"][0]["name"] == "exactly zero"
    assert {"label": "head.weight", "value": "head.weight"} in answer[ids.LAYER_PICK]["options"]
    assert '"href": "/dashboard/run/7"' in json.dumps(answer[ids.LAYER_HEADER])

    # A heatmap cell's step, its bucket's start (3): the first histogram from there on.
    transport = collector_transport()
    body["inputs"][0]["value"] = {**key, "step": 3}
    response = make_app(transport).server.test_client().post("/_dash-update-component", json=body)
    histogram = json.loads(response.get_data(as_text=True))["response"][ids.LAYER_HISTOGRAM_GRAPH][
        "figure"
    ]
    assert histogram["layout"]["sliders"][0]["active"] == 1  # step 4, not 2
    (exact,) = [
        dict(r.url.params)
        for r in transport.requests  # type: ignore[attr-defined]
        if r.url.path.endswith("/histograms") and "start" in r.url.params
    ]
    assert (exact["start"], exact["max_points"]) == ("3", "1")
    # The loss scales come with the histograms: no second read of the step series.
    assert not [r for r in transport.requests if r.url.path.endswith("/steps")]  # type: ignore[attr-defined]

    key["layer"] = "nosuch.weight"
    body["inputs"][0]["value"] = key
    response = app.server.test_client().post("/_dash-update-component", json=body)
    assert "There is no layer 'nosuch.weight' in run 7" in response.get_data(as_text=True)


def test_compare_overlays_the_picked_runs(collector_transport: MakeTransport) -> None:
    app = make_app(collector_transport())
    figure = call_callback(
        app, (ids.COMPARE_GRAPH, "figure"), [(ids.COMPARE_PICK, "value", [RUN_ID, RUN_ID])]
    )
    names = [t["name"] for t in figure["data"]]
    assert names == ["gpt-small"] * 3 + ["gpt-small (2)"] * 3


def test_unknown_run_and_unreachable_collector_render_messages_not_errors(
    collector_transport: MakeTransport,
) -> None:
    client = CollectorClient("http://collector.test", transport=collector_transport())
    missing = fetch_run_data(client, 999)
    assert missing["error"] == "There is no run 999 on this collector."
    assert render_run(missing)[-1] == {"display": "none"}

    down = create_dash_app("http://127.0.0.1:9")  # discard port: nothing listens
    assert "is it running" in routed_page(down, "/run/7")
    data = call_callback(down, (ids.RUNS_DATA, "data"), [(ids.RUNS_REFRESH, "n_intervals", 0)])
    assert "is it running" in data["error"]
    assert "is it running" in json.dumps(
        call_callback(
            down,
            (ids.RUNS_TABLE, "children"),
            [
                (ids.RUNS_DATA, "data", data),
                (ids.RUNS_FILTER_TEXT, "value", ""),
                (ids.RUNS_FILTER_HEALTH, "value", "any"),
                (ids.RUNS_FILTER_STATUS, "value", "any"),
                (ids.RUNS_SORT, "data", runs.DEFAULT_SORT),
            ],
        )
    )


def test_two_apps_in_one_process_keep_their_own_collectors(
    collector_transport: MakeTransport, run_json: dict[str, Any]
) -> None:
    other_run = {**run_json, "name": "bert-large"}
    first = create_dash_app("http://a.test", transport=collector_transport())
    second = create_dash_app(
        "http://b.test",
        requests_pathname_prefix="/other/",
        transport=collector_transport(**{"/api/v1/runs": {"runs": [other_run]}}),
    )
    fetched = [
        call_callback(app, (ids.RUNS_DATA, "data"), [(ids.RUNS_REFRESH, "n_intervals", 0)])
        for app in (first, second)
    ]
    assert fetched[0]["runs"][0]["name"] == "gpt-small"
    assert fetched[1]["runs"][0]["name"] == "bert-large"
    assert '"/other/run/7"' in runs_table(second, fetched[1]["runs"])
    assert first.callback_map.keys() == second.callback_map.keys()


def test_mounted_in_fastapi_with_a2wsgi_serves_under_the_prefix() -> None:
    """The collector's embedded mount: Flask routes at /, the browser sees /dashboard/."""
    dash_app = create_dash_app("http://collector.test", requests_pathname_prefix="/dashboard/")
    api = FastAPI()
    api.mount("/dashboard", WSGIMiddleware(dash_app.server))  # type: ignore[arg-type]

    async def get_all(paths: list[str]) -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return [await http.get(path) for path in paths]

    index, run_page, layout = asyncio.run(
        get_all(["/dashboard/", "/dashboard/run/7", "/dashboard/_dash-layout"])
    )
    assert index.status_code == run_page.status_code == layout.status_code == 200
    assert "/dashboard/_dash-component-suites/" in index.text
    assert '"requests_pathname_prefix":"\\u002fdashboard\\u002f"' in index.text
    assert layout.json()["props"]["children"][0]["props"]["id"] == ids.URL


def test_before_the_first_fetch_the_graphs_say_loading() -> None:
    header, *graphs, _alerts, _checkpoints, style = render_run(None)
    assert header is dash.no_update  # the layout's "Run <id>" heading stays
    assert [g.layout.annotations[0].text for g in graphs] == ["Loading…"] * 6
    assert style == {}


def test_picking_another_heatmap_statistic_fetches_only_the_heatmap(
    collector_transport: MakeTransport,
    layers_json: dict[str, Any],
) -> None:
    transport = collector_transport()
    client = CollectorClient("http://collector.test", transport=transport)
    stored = fetch_run_data(client, RUN_ID)
    transport.requests.clear()  # type: ignore[attr-defined]
    patch, cursor = update_run_data(client, RUN_ID, cursor_of(stored), "flush_fraction")
    assert cursor["stat"] == "flush_fraction"
    operations = patch.to_plotly_json()["operations"]
    assert sorted(op["location"] for op in operations) == [["heatmap"], ["heatmap_next"]]
    (request,) = transport.requests  # type: ignore[attr-defined]
    assert request.url.params["stat"] == "flush_fraction"


def test_a_model_wide_alert_storm_shows_the_worst_and_counts_the_rest(
    alerts_json: dict[str, Any],
) -> None:
    collapse, underflow = (Alert.from_json(a) for a in alerts_json["alerts"])
    storm = [
        Alert.from_json(
            {
                **alerts_json["alerts"][1],
                "id": 10 + i,
                "rule": "underflow_risk",
                "layer": f"blocks.{i}.weight",
                "severity": "warning",
                "status": "firing",
                "fired_step": i,
            }
        )
        for i in range(100)
    ]
    shown, hidden = select_alerts([underflow, *storm, collapse], limit=5)
    assert shown[0] == collapse  # firing, critical, run-wide
    assert [a.layer for a in shown[1:]] == [f"blocks.{i}.weight" for i in (99, 98, 97, 96)]
    assert hidden == {"underflow_risk": 96, "silent_underflow": 1}  # resolved comes last
    assert hidden_note(hidden) == "and 97 more: underflow_risk × 96, silent_underflow × 1"
