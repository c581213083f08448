"""The app through its real HTTP surface (Flask test client, and mounted in FastAPI)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any

import dash
import httpx
from a2wsgi import WSGIMiddleware
from fastapi import FastAPI

from ampwatch.dashboard import ids
from ampwatch.dashboard.app import create_dash_app
from ampwatch.dashboard.client import StepSeries
from ampwatch.dashboard.pages.run import render_run

MakeTransport = Callable[..., httpx.MockTransport]
RUN_ID = 7  # the run the `collector_transport` fixture serves


def call_callback(
    app: dash.Dash,
    output: tuple[str, str],
    inputs: list[tuple[str, str, Any]],
    state: list[tuple[str, str, Any]] = [],  # noqa: B006 - never mutated
) -> Any:
    """POST one callback the way the Dash renderer does and return the output's value."""
    body = {
        "output": f"{output[0]}.{output[1]}",
        "outputs": {"id": output[0], "property": output[1]},
        "inputs": [{"id": i, "property": p, "value": v} for i, p, v in inputs],
        "changedPropIds": [f"{i}.{p}" for i, p, _ in inputs],
        "state": [{"id": i, "property": p, "value": v} for i, p, v in state],
    }
    response = app.server.test_client().post("/_dash-update-component", json=body)
    assert response.status_code == 200, response.get_data(as_text=True)
    return json.loads(response.get_data(as_text=True))["response"][output[0]][output[1]]


def routed_page(app: dash.Dash, pathname: str) -> str:
    return json.dumps(call_callback(app, (ids.PAGE, "children"), [(ids.URL, "pathname", pathname)]))


def fetch(app: dash.Dash, run_id: int) -> dict[str, Any]:
    result: dict[str, Any] = call_callback(
        app,
        (ids.RUN_DATA, "data"),
        [(ids.RUN_REFRESH, "n_intervals", None)],
        [(ids.RUN_ID, "data", run_id)],
    )
    return result


def test_router_strips_the_mount_prefix(collector_transport: MakeTransport) -> None:
    app = create_dash_app(
        "http://collector.test",
        requests_pathname_prefix="/dashboard/",
        transport=collector_transport(),
    )
    assert ids.RUNS_TABLE in routed_page(app, "/dashboard/")
    run_page = routed_page(app, "/dashboard/run/7")
    assert ids.ZERO_FRACTION_GRAPH in run_page and '"data": 7' in run_page
    assert "Page not found" in routed_page(app, "/dashboard/run/abc")


def test_runs_table_links_to_run_pages_under_the_prefix(
    collector_transport: MakeTransport,
) -> None:
    app = create_dash_app(
        "http://collector.test",
        requests_pathname_prefix="/dashboard/",
        transport=collector_transport(),
    )
    table = json.dumps(
        call_callback(app, (ids.RUNS_TABLE, "children"), [(ids.RUNS_REFRESH, "n_intervals", 0)])
    )
    assert '"href": "/dashboard/run/7"' in table
    assert "gpt-small" in table and "16384 (2^14)" in table


def test_fetch_keeps_nan_apart_from_null_in_the_store(
    collector_transport: MakeTransport,
) -> None:
    app = create_dash_app("http://collector.test", transport=collector_transport())
    data = fetch(app, RUN_ID)
    assert data["steps"]["loss"] == [2.5, 2.4, "Infinity", 2.2, "NaN", 2.0]
    assert data["steps"]["grad_norm"][2] is None
    assert math.isnan(StepSeries.from_json(data["steps"]).loss[4])  # type: ignore[arg-type]
    _header, loss_scale, activation_norm, zero_fraction, style = render_run(data)
    assert [len(f.data) for f in (loss_scale, activation_norm, zero_fraction)] == [4, 2, 1]
    assert style == {}


def test_unknown_run_and_unreachable_collector_render_messages_not_errors(
    collector_transport: MakeTransport,
) -> None:
    app = create_dash_app("http://collector.test", transport=collector_transport())
    missing = fetch(app, 999)
    assert missing["error"] == "There is no run 999 on this collector."
    *_, style = render_run(missing)
    assert style == {"display": "none"}

    down = create_dash_app("http://127.0.0.1:9")  # discard port: nothing listens
    assert "is it running" in fetch(down, RUN_ID)["error"]
    table = call_callback(
        down, (ids.RUNS_TABLE, "children"), [(ids.RUNS_REFRESH, "n_intervals", 0)]
    )
    assert "is it running" in json.dumps(table)


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
    tables = [
        json.dumps(
            call_callback(app, (ids.RUNS_TABLE, "children"), [(ids.RUNS_REFRESH, "n_intervals", 0)])
        )
        for app in (first, second)
    ]
    assert "gpt-small" in tables[0] and "bert-large" not in tables[0]
    assert "bert-large" in tables[1] and '"/other/run/7"' in tables[1]
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
    header, *graphs, style = render_run(None)
    assert header is dash.no_update  # the layout's "Run <id>" heading stays
    assert [g.layout.annotations[0].text for g in graphs] == ["Loading…"] * 3
    assert style == {}
