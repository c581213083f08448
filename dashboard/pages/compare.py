"""Compare (`/compare?runs=1,2`): two or more runs overlaid on one step axis -- loss, loss
scale (log2, with each run's effective min_scale line) and final-layer activation norm.
`?runs=` preselects runs, so a comparison can be linked."""

from __future__ import annotations

from typing import Any

import dash
import plotly.graph_objects as go
from dash import Input, Output, dcc, html

from ampwatch.dashboard import compare_figures, figure_common, ids
from ampwatch.dashboard.client import CollectorClient, CollectorError
from ampwatch.dashboard.series_types import StepSeries

GRAPH_CONFIG = dcc.Graph.Config(displaylogo=False, responsive=True)
#: Points per run: several runs share one chart, so each gets fewer than a run page's.
COMPARE_POINTS = 1000


def layout(
    run_ids: list[int] | None = None, client: CollectorClient | None = None, **_kwargs: Any
) -> html.Div:
    """The picker lists the collector's runs when the page is drawn: a dropdown whose
    value is not among its options would drop it."""
    options: list[dict[str, Any]] = []
    if client is not None:
        try:
            options = [
                {"label": f"{run.name} ({run.project}, #{run.id})", "value": run.id}
                for run in client.list_runs()
            ]
        except CollectorError:
            pass
    known = {option["value"] for option in options}
    return html.Div(
        [
            html.H2("Compare runs"),
            dcc.Dropdown(
                id=ids.COMPARE_PICK,
                multi=True,
                options=options,
                value=[r for r in run_ids or [] if r in known],
                placeholder="pick two or more runs…",
            ),
            dcc.Graph(
                id=ids.COMPARE_GRAPH, config=GRAPH_CONFIG, figure=compare_figures.compare_figure([])
            ),
        ]
    )


def register_callbacks(app: dash.Dash, client: CollectorClient) -> None:
    @app.callback(Output(ids.COMPARE_GRAPH, "figure"), Input(ids.COMPARE_PICK, "value"))
    def compare(run_ids: list[int] | None) -> go.Figure:
        try:
            runs = [
                (client.get_run(int(r)).name, client.steps(int(r), max_points=COMPARE_POINTS))
                for r in run_ids or []
            ]
        except CollectorError as exc:
            return figure_common.empty_figure("Compare runs", str(exc))
        return compare_figures.compare_figure(unique_names(runs))


def unique_names(runs: list[tuple[str, StepSeries]]) -> list[tuple[str, StepSeries]]:
    """Run names as legend entries, numbered when two runs share a name."""
    seen: dict[str, int] = {}
    out = []
    for name, series in runs:
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f"{name} ({seen[name]})", series))
    return out
