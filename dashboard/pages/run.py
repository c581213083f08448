"""Run page (`/run/<id>`): loss scale and skips, final-layer activation norm, zero-grad heatmap.

One callback fetches everything the page shows into a `dcc.Store` (in the API's JSON shape,
so NaN survives); a second builds the header and figures from the store with the pure
functions in `figures.py`. An interval re-runs the fetch so a live run updates in place.
"""

from __future__ import annotations

from typing import Any

import dash
import plotly.graph_objects as go
from dash import Input, Output, State, dcc, html

from ampwatch.dashboard import figures, ids
from ampwatch.dashboard.client import (
    CollectorClient,
    CollectorError,
    LayerMatrix,
    RunEvent,
    RunNotFound,
    RunSummary,
    StepSeries,
)

REFRESH_MS = 5_000
GRAPH_CONFIG = dcc.Graph.Config(displaylogo=False, responsive=True)


def layout(run_id: int = 0, **_kwargs: Any) -> html.Div:
    return html.Div(
        [
            dcc.Store(id=ids.RUN_ID, data=run_id),
            dcc.Store(id=ids.RUN_DATA),
            dcc.Interval(id=ids.RUN_REFRESH, interval=REFRESH_MS),
            html.Div(id=ids.RUN_HEADER, children=html.H2(f"Run {run_id}")),
            html.Div(
                id=ids.RUN_GRAPHS,
                children=[
                    dcc.Graph(id=ids.LOSS_SCALE_GRAPH, config=GRAPH_CONFIG),
                    dcc.Graph(id=ids.ACTIVATION_NORM_GRAPH, config=GRAPH_CONFIG),
                    dcc.Graph(id=ids.ZERO_FRACTION_GRAPH, config=GRAPH_CONFIG),
                ],
            ),
        ]
    )


def fetch_run_data(client: CollectorClient, run_id: int) -> dict[str, Any]:
    """Everything the run page draws, as JSON for the store; `error` set instead on failure."""
    try:
        run = client.get_run(run_id)
        steps = client.steps(run_id)
        zero_fraction = client.layer_matrix(run_id, "zero_fraction")
        events = client.events(run_id)
    except RunNotFound:
        return {"error": f"There is no run {run_id} on this collector."}
    except CollectorError as exc:
        return {"error": str(exc)}
    return {
        "run": run.to_json(),
        "steps": steps.to_json(),
        "zero_fraction": zero_fraction.to_json(),
        "events": [event.to_json() for event in events],
    }


def run_header(run: RunSummary) -> html.Div:
    facts = [
        ("project", run.project),
        ("status", run.status),
        ("last step", "—" if run.last_step is None else str(run.last_step)),
        ("loss scale", figures.format_loss_scale(run.last_loss_scale)),
        ("skipped steps", str(run.skipped_steps)),
        ("last seen", figures.format_time(run.last_seen_at)),
    ]
    return html.Div(
        [
            html.H2(run.name),
            html.Dl(
                [item for label, value in facts for item in (html.Dt(label), html.Dd(value))],
                className="facts",
            ),
        ]
    )


RunView = tuple[Any, go.Figure, go.Figure, go.Figure, dict[str, str]]
HIDDEN = {"display": "none"}


def render_run(data: dict[str, Any] | None) -> RunView:
    """Header, the three figures and the graphs' style from the store's content.

    Before the first fetch (`data` is None) the graphs say they are loading under the
    layout's "Run <id>" heading; after a failed fetch the header says why and the graphs
    are hidden rather than repeating it three times.
    """
    if data is None:
        loading = "Loading…"
        return (
            dash.no_update,
            figures.empty_figure("Loss scale and loss", loading),
            figures.empty_figure("Final-layer activation norm", loading),
            figures.empty_figure("Zero-gradient fraction per layer", loading),
            {},
        )
    if "error" in data:
        blank = go.Figure()
        return (html.P(data["error"], className="error"), blank, blank, blank, HIDDEN)
    steps = StepSeries.from_json(data["steps"])
    checkpoints = [
        event.step
        for event in map(RunEvent.from_json, data["events"])
        if event.kind == "checkpoint" and event.step is not None
    ]
    return (
        run_header(RunSummary.from_json(data["run"])),
        figures.loss_scale_figure(steps, checkpoint_steps=checkpoints),
        figures.activation_norm_figure(steps),
        figures.zero_fraction_heatmap(LayerMatrix.from_json(data["zero_fraction"])),
        {},
    )


def register_callbacks(app: dash.Dash, client: CollectorClient) -> None:
    @app.callback(
        Output(ids.RUN_DATA, "data"),
        Input(ids.RUN_REFRESH, "n_intervals"),
        State(ids.RUN_ID, "data"),
    )
    def fetch(_n_intervals: int | None, run_id: int) -> dict[str, Any]:
        return fetch_run_data(client, run_id)

    @app.callback(
        Output(ids.RUN_HEADER, "children"),
        Output(ids.LOSS_SCALE_GRAPH, "figure"),
        Output(ids.ACTIVATION_NORM_GRAPH, "figure"),
        Output(ids.ZERO_FRACTION_GRAPH, "figure"),
        Output(ids.RUN_GRAPHS, "style"),
        Input(ids.RUN_DATA, "data"),
    )
    def render(data: dict[str, Any] | None) -> RunView:
        return render_run(data)
