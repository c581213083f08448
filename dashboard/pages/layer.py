"""Layer drill-down (`/run/<id>/layer/<name>?step=N`): one parameter tensor's statistics over
steps, and its gradient-exponent histogram against the FP8/FP16/BF16 ranges, at a chosen
step (the slider; `?step=` picks the first one shown) or animated over steps (play).

The loss scale at each histogram's step comes with the histogram (the collector reads it
from that step's record), exact at any zoom.
"""

from __future__ import annotations

from typing import Any

import dash
import plotly.graph_objects as go
from dash import Input, Output, State, dcc, html

from ampwatch.agent.wire import LAYER_STATS
from ampwatch.dashboard import figure_common, ids
from ampwatch.dashboard.client import CollectorClient, CollectorError, RunNotFound
from ampwatch.dashboard.layer_figures import exponent_histogram_figure, layer_series_figure
from ampwatch.dashboard.urls import href, layer_path, run_path

GRAPH_CONFIG = dcc.Graph.Config(displaylogo=False, responsive=True)
FRACTION_STATS = tuple(s for s in LAYER_STATS if s.endswith("_fraction"))


def layout(run_id: int = 0, layer: str = "", step: int | None = None, **_kwargs: Any) -> html.Div:
    return html.Div(
        [
            dcc.Store(id=ids.LAYER_KEY, data={"run_id": run_id, "layer": layer, "step": step}),
            html.Div(id=ids.LAYER_HEADER, children=html.H2(layer)),
            dcc.Dropdown(
                id=ids.LAYER_PICK,
                value=layer,
                clearable=False,
                options=[{"label": layer, "value": layer}],
            ),
            dcc.Graph(
                id=ids.LAYER_HISTOGRAM_GRAPH,
                config=GRAPH_CONFIG,
                figure=figure_common.empty_figure("Gradient exponent histogram", "Loading…"),
            ),
            dcc.Graph(
                id=ids.LAYER_SERIES_GRAPH,
                config=GRAPH_CONFIG,
                figure=figure_common.empty_figure("Gradient statistics of this layer", "Loading…"),
            ),
        ]
    )


def index_from(steps: list[int], step: int | None) -> int | None:
    """The index of the first of sorted `steps` at or after `step`, else the last (None:
    no preference). A heatmap cell names its bucket's start, before the bucket's first
    sampled step.

    >>> index_from([10, 20, 30], 14), index_from([10, 20], 25), index_from([10], None)
    (1, 1, None)
    """
    if step is None or not steps:
        return None
    return next((i for i, s in enumerate(steps) if s >= step), len(steps) - 1)


LayerView = tuple[Any, go.Figure, go.Figure, list[dict[str, str]]]


def layer_view(
    client: CollectorClient, run_id: int, layer: str, step: int | None, back: str
) -> LayerView:
    """Header, histogram figure, series figure and the layer dropdown's options."""
    try:
        run = client.get_run(run_id)
        names = client.layer_names(run_id)
        if layer not in names:
            raise RunNotFound(layer)
        series = {stat: client.layer_series(run_id, layer, stat) for stat in FRACTION_STATS}
        max_abs = client.layer_series(run_id, layer, "max_abs_scaled")
        hists = client.layer_histograms(run_id, layer)
        if step is not None and step not in hists.steps:  # the first sampled from `step`
            hists = hists.merged(client.layer_histograms(run_id, layer, start=step, max_points=1))
    except RunNotFound:
        message = f"There is no layer {layer!r} in run {run_id} on this collector."
        blank = go.Figure()
        return (
            html.Div([html.P(message, className="error"), dcc.Link("← back", href=back)]),
            blank,
            blank,
            [],
        )
    except CollectorError as exc:
        blank = go.Figure()
        return html.P(str(exc), className="error"), blank, blank, []
    header = html.Div(
        [
            html.Div(
                [dcc.Link(f"← {run.name}", href=back), html.Span(" / layer", className="muted")],
                className="crumbs",
            ),
            html.H2(layer),
        ]
    )
    return (
        header,
        exponent_histogram_figure(hists, hists.scales(), active=index_from(hists.steps, step)),
        layer_series_figure(series, max_abs),
        [{"label": name, "value": name} for name in names],
    )


def register_callbacks(app: dash.Dash, client: CollectorClient) -> None:
    @app.callback(
        Output(ids.LAYER_HEADER, "children"),
        Output(ids.LAYER_HISTOGRAM_GRAPH, "figure"),
        Output(ids.LAYER_SERIES_GRAPH, "figure"),
        Output(ids.LAYER_PICK, "options"),
        Input(ids.LAYER_KEY, "data"),
    )
    def render(key: dict[str, Any]) -> LayerView:
        run_id = int(key["run_id"])
        return layer_view(
            client, run_id, str(key["layer"]), key.get("step"), href(app, run_path(run_id))
        )

    @app.callback(
        Output(ids.URL, "href", allow_duplicate=True),
        Input(ids.LAYER_PICK, "value"),
        State(ids.LAYER_KEY, "data"),
        prevent_initial_call=True,
    )
    def pick(layer: str | None, key: dict[str, Any]) -> Any:
        if not layer or layer == key["layer"]:
            return dash.no_update
        return href(app, layer_path(int(key["run_id"]), layer))
