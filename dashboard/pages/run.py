"""Run page (`/run/<id>`): is every layer still learning, is the scale healthy, where to restart.

Charts: loss scale (log2, the scale lines the run's rules judge by, skipped steps,
checkpoints with the advisor's verdicts) over the loss; skip rate; gradient norm;
final-layer activation norm with activation_norm_spike's own threshold; a layers × steps heatmap (zero-gradient fraction, FP16-subnormal share or
flush-to-zero forecast; click a row for the layer's page); the alerts as a timeline with
their explanations; the checkpoints with the restart advisor's verdicts. After a resume
from a plan (`watch(resume_from=)`), the loss, loss-scale and grad-norm charts draw the
abandoned tail greyed under the new branch (`step_figures.abandoned_traces`).

Data flow: the page comes drawn with its data (`layout(run_id, client)`, in the app's
initial layout or from the router), then three callbacks (their reads and the stores'
changes are `ampwatch.dashboard.pages.run_store`; the HTML around the charts `run_panels`):
- `fetch` (every `REFRESH_MS`): sends the server only `RUN_CURSOR` (where the stored data
  ends), and reads only steps and heatmap rows after it, appended to the `RUN_DATA` store
  (API JSON shape, so NaN survives) with a `Patch` (the browser receives the new points
  only), plus the small things that change in place (run summary, alerts, advisor); an
  unchanged run summary ends the tick, and a new `resumed` event reads everything again
  (the collector moved the steps after its checkpoint aside). When the appended tail outgrows the first answer
  it refetches once, so the store stays downsampled.
- `zoom`: a step chart's relayoutData (x range) fetches that window again from the
  collector at full resolution (its downsampling gives finer buckets for a narrower
  window) into `RUN_ZOOM`; a double-click (autorange) clears it.
- `render`: header, figures, alert list and checkpoint table from both stores.
"""

from __future__ import annotations

from typing import Any

import dash
import plotly.graph_objects as go
from dash import Input, Output, State, ctx, dcc, html
from dash.exceptions import PreventUpdate

from ampwatch.dashboard import (
    alert_figures,
    figure_common,
    heatmap_figures,
    ids,
    loss_scale_figures,
    step_figures,
)
from ampwatch.dashboard.client import CollectorClient
from ampwatch.dashboard.pages.run_panels import (
    alerts_list,
    checkpoints_table,
    hidden_note,
    run_header,
)
from ampwatch.dashboard.pages.run_store import (
    cursor_of,
    fetch_run_data,
    fetch_zoom,
    replaced,
    update_run_data,
    zoom_window,
)
from ampwatch.dashboard.run_types import Alert, RestartAdvice, RunEvent, RunSummary
from ampwatch.dashboard.series_types import AbandonedTail, LayerMatrix, StepSeries
from ampwatch.dashboard.urls import href, layer_path

REFRESH_MS = 5_000
GRAPH_CONFIG = dcc.Graph.Config(displaylogo=False, responsive=True)
HEATMAP_OPTIONS = [
    {"label": "zero-gradient fraction", "value": "zero_fraction"},
    {"label": "FP16-subnormal share", "value": "subnormal_fraction"},
    {"label": "flush-to-zero forecast", "value": "flush_fraction"},
]
#: Layers the "open a layer" dropdown offers at once: the first ones, or those matching
#: what is typed into it.
LAYER_OPTIONS = 30
HIDDEN = {"display": "none"}


def layout(
    run_id: int = 0,
    client: CollectorClient | None = None,
    data: dict[str, Any] | None = None,
    fp8_href: str | None = None,
    **_kwargs: Any,
) -> html.Div:
    """The page, drawn with the run's data -- `data` as `fetch_run_data` returns it, or
    read through `client` -- so the first render needs no callback round trip (fetch,
    then render) of its own."""
    if data is None and client is not None:
        data = fetch_run_data(client, run_id)
    (
        header,
        loss_scale,
        skip_rate,
        grad_norm,
        activation,
        heatmap,
        alerts,
        alert_items,
        checkpoints,
        style,
    ) = render_run(data)

    def graph(graph_id: str, figure: go.Figure) -> dcc.Graph:
        return dcc.Graph(id=graph_id, figure=figure, config=GRAPH_CONFIG)

    return html.Div(
        [
            dcc.Store(id=ids.RUN_ID, data=run_id),
            dcc.Store(id=ids.RUN_DATA, data=data),
            dcc.Store(id=ids.RUN_CURSOR, data=cursor_of(data)),
            dcc.Store(id=ids.RUN_ZOOM),
            dcc.Interval(id=ids.RUN_REFRESH, interval=REFRESH_MS),
            html.Div(
                id=ids.RUN_HEADER,
                children=html.H2(f"Run {run_id}") if header is dash.no_update else header,
            ),
            dcc.Link(
                "FP8 readiness and loss-scale advice →",
                href=fp8_href or "",
                className="nav",
                style={} if fp8_href else HIDDEN,
            ),
            html.Div(
                id=ids.RUN_GRAPHS,
                style=style,
                children=[
                    graph(ids.LOSS_SCALE_GRAPH, loss_scale),
                    html.Div(
                        [
                            graph(ids.SKIP_RATE_GRAPH, skip_rate),
                            graph(ids.GRAD_NORM_GRAPH, grad_norm),
                        ],
                        className="pair",
                    ),
                    graph(ids.ACTIVATION_NORM_GRAPH, activation),
                    html.Div(
                        [
                            dcc.RadioItems(
                                id=ids.HEATMAP_STAT,
                                options=HEATMAP_OPTIONS,
                                value="zero_fraction",
                                inline=True,
                            ),
                            dcc.Dropdown(
                                id=ids.RUN_LAYER_PICK, placeholder="open a layer…", clearable=True
                            ),
                        ],
                        className="controls",
                    ),
                    graph(ids.HEATMAP_GRAPH, heatmap),
                    graph(ids.ALERTS_GRAPH, alerts),
                    html.Div(id=ids.ALERTS_LIST, children=alert_items),
                    html.H3("Checkpoints"),
                    html.Div(id=ids.CHECKPOINTS_TABLE, children=checkpoints),
                ],
            ),
        ]
    )


def run_span(series: StepSeries) -> tuple[int, int] | None:
    return (series.step[0], series.step[-1]) if series.step else None


RunView = tuple[Any, ...]
STEP_FIGURE_TITLES = (
    "Loss scale and loss",
    "Skip rate",
    "Gradient norm",
    "Final-layer activation norm",
    "Zero-gradient fraction per layer",
    "Alerts",
)


def render_run(data: dict[str, Any] | None, zoom: dict[str, Any] | None = None) -> RunView:
    """Header, the six figures, alert list, checkpoint table and the graphs' style from the
    stores' content.

    Before the first fetch (`data` is None) the graphs say they are loading under the
    layout's "Run <id>" heading; after a failed fetch the header says why and the graphs
    are hidden rather than repeating it six times.
    """
    if data is None:
        loading = [figure_common.empty_figure(title, "Loading…") for title in STEP_FIGURE_TITLES]
        return (dash.no_update, *loading, None, None, {})
    if "error" in data:
        blank = [go.Figure() for _ in STEP_FIGURE_TITLES]
        return (html.P(data["error"], className="error"), *blank, None, None, HIDDEN)
    zoomed = zoom is not None and "error" not in zoom
    source = zoom if zoomed else data
    assert source is not None
    x_range = (zoom["start"], zoom["end"]) if zoomed and zoom is not None else None
    full_steps = StepSeries.from_json(data["steps"])
    steps = StepSeries.from_json(source["steps"]) if zoomed else full_steps
    events = [RunEvent.from_json(e) for e in data["events"]]
    stored_alerts = data.get("alerts")
    alerts = None if stored_alerts is None else [Alert.from_json(a) for a in stored_alerts["shown"]]
    hidden = {} if stored_alerts is None else stored_alerts["hidden"]
    advice = None if data.get("advice") is None else RestartAdvice.from_json(data["advice"])
    if advice is not None:
        checkpoints = {c.step: c.verdict for c in advice.candidates if c.step is not None}
    else:
        checkpoints = {e.step: "" for e in events if e.kind == "checkpoint" and e.step is not None}
    run = RunSummary.from_json(data["run"])
    abandoned = [AbandonedTail.from_json(t) for t in data.get("abandoned") or []]
    return (
        run_header(run),
        loss_scale_figures.loss_scale_figure(
            steps,
            checkpoints=checkpoints,
            alerts=alerts or (),
            abandoned=abandoned,
            x_range=x_range,
        ),
        step_figures.skip_rate_figure(steps, x_range=x_range),
        step_figures.grad_norm_figure(steps, abandoned=abandoned, x_range=x_range),
        step_figures.activation_norm_figure(steps, x_range=x_range),
        heatmap_figures.layer_heatmap(LayerMatrix.from_json(source["heatmap"]), x_range=x_range),
        alert_figures.alerts_timeline_figure(
            alerts,
            full_steps.last_step,
            x_range=x_range or run_span(full_steps),
            note=hidden_note(hidden),
        ),
        alerts_list(alerts, hidden),
        checkpoints_table(advice, events),
        {},
    )


#: In the browser, from the store's layer names: the dropdown indexes every option it is
#: given for its search when it mounts, 300 ms of the first render for 500 layers.
LAYER_SEARCH = f"""function (search, data) {{
            const needle = (search || "").toLowerCase();
            return ((data && data.layers) || [])
                .filter(name => name.toLowerCase().includes(needle))
                .slice(0, {LAYER_OPTIONS}).map(name => ({{label: name, value: name}}));
        }}"""


def register_callbacks(app: dash.Dash, client: CollectorClient) -> None:
    _register_reads(app, client)
    _register_render(app)
    _register_layer_links(app)


def _register_reads(app: dash.Dash, client: CollectorClient) -> None:
    """The callbacks that fill the stores: `fetch` (the refresh) and `zoom`."""

    @app.callback(
        Output(ids.RUN_DATA, "data"),
        Output(ids.RUN_CURSOR, "data"),
        Input(ids.RUN_REFRESH, "n_intervals"),
        Input(ids.HEATMAP_STAT, "value"),
        State(ids.RUN_ID, "data"),
        State(ids.RUN_CURSOR, "data"),
        prevent_initial_call=True,
    )
    def fetch(
        _n_intervals: int | None, stat: str | None, run_id: int, cursor: dict[str, Any] | None
    ) -> tuple[Any, Any]:
        if ctx.triggered_id is None and cursor:
            return dash.no_update, dash.no_update  # drawn with fresh data a moment ago
        stat = stat or "zero_fraction"
        if not cursor or cursor.get("run_id") != run_id:
            return replaced(fetch_run_data(client, run_id, stat))
        return update_run_data(client, run_id, cursor, stat)

    @app.callback(
        Output(ids.RUN_ZOOM, "data"),
        *(Input(graph, "relayoutData") for graph in ids.ZOOMABLE_GRAPHS),
        Input(ids.HEATMAP_STAT, "value"),
        State(ids.RUN_ID, "data"),
        State(ids.RUN_ZOOM, "data"),
        prevent_initial_call=True,
    )
    def zoom(*args: Any) -> Any:
        *relayouts, stat, run_id, current = args
        if ctx.triggered_id == ids.HEATMAP_STAT:
            if not current or "error" in current:
                return dash.no_update
            return fetch_zoom(client, run_id, (current["start"], current["end"]), stat)
        relayout = relayouts[ids.ZOOMABLE_GRAPHS.index(ctx.triggered_id)]
        window = zoom_window(relayout)
        if window is False:
            return dash.no_update
        if window is None:
            return None
        assert isinstance(window, tuple)
        return fetch_zoom(client, run_id, window, stat or "zero_fraction")


def _register_render(app: dash.Dash) -> None:
    """`render`: the page from both stores (`render_run`)."""

    @app.callback(
        Output(ids.RUN_HEADER, "children"),
        Output(ids.LOSS_SCALE_GRAPH, "figure"),
        Output(ids.SKIP_RATE_GRAPH, "figure"),
        Output(ids.GRAD_NORM_GRAPH, "figure"),
        Output(ids.ACTIVATION_NORM_GRAPH, "figure"),
        Output(ids.HEATMAP_GRAPH, "figure"),
        Output(ids.ALERTS_GRAPH, "figure"),
        Output(ids.ALERTS_LIST, "children"),
        Output(ids.CHECKPOINTS_TABLE, "children"),
        Output(ids.RUN_GRAPHS, "style"),
        Input(ids.RUN_DATA, "data"),
        Input(ids.RUN_ZOOM, "data"),
        prevent_initial_call=True,
    )
    def render(data: dict[str, Any] | None, zoom: dict[str, Any] | None) -> RunView:
        if ctx.triggered_id is None and data:
            raise PreventUpdate  # the layout already shows this data
        return render_run(data, zoom)


def _register_layer_links(app: dash.Dash) -> None:
    """The way to a layer's page: the dropdown's options (`LAYER_SEARCH`), and a heatmap
    row or the dropdown's pick opening it."""
    app.clientside_callback(  # type: ignore[no-untyped-call]
        LAYER_SEARCH,
        Output(ids.RUN_LAYER_PICK, "options"),
        Input(ids.RUN_LAYER_PICK, "search_value"),
        Input(ids.RUN_DATA, "data"),
    )

    @app.callback(
        Output(ids.URL, "href"),
        Input(ids.HEATMAP_GRAPH, "clickData"),
        Input(ids.RUN_LAYER_PICK, "value"),
        State(ids.RUN_ID, "data"),
        prevent_initial_call=True,
    )
    def open_layer(click: dict[str, Any] | None, picked: str | None, run_id: int) -> Any:
        """A heatmap row (at the clicked step) or the dropdown's layer opens its page."""
        if ctx.triggered_id == ids.HEATMAP_GRAPH and click and click.get("points"):
            point = click["points"][0]
            return href(app, layer_path(run_id, str(point["y"]))) + f"?step={int(point['x'])}"
        if ctx.triggered_id == ids.RUN_LAYER_PICK and picked:
            return href(app, layer_path(run_id, picked))
        return dash.no_update
