"""FP8 readiness (`/run/<id>/fp8`): which Linear layers of this run would lose what under
each FP8 recipe (layers x recipes, worst first, a verdict per layer with its numbers, the
trend over the run), and, for FP16 runs, the loss-scale advice from the exponent histograms.

Drawn with its data (no fetch round trip); the figures are pure functions in
`fp8_figures.py`. Data: `/fp8-readiness` and `/loss-scale-advice` (read as "not available"
from a collector without them).
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, dcc, html

from ampwatch.dashboard import ids
from ampwatch.dashboard.client import CollectorClient, CollectorError, RunNotFound
from ampwatch.dashboard.fp8_figures import (
    VERDICT_LABELS,
    loss_scale_figure,
    readiness_matrix_figure,
    readiness_trend_figure,
    verdict_rows,
)

GRAPH_CONFIG = dcc.Graph.Config(displaylogo=False, responsive=True)
TABLE_ROWS = 50


def _table(rows: list[dict[str, str]]) -> html.Table:
    if not rows:
        return html.Table()
    columns = list(rows[0])
    return html.Table(
        [
            html.Thead(html.Tr([html.Th(c) for c in columns])),
            html.Tbody([html.Tr([html.Td(row[c]) for c in columns]) for row in rows[:TABLE_ROWS]]),
        ],
        className="fp8-verdicts",
    )


def fp8_view(
    client: CollectorClient | None, run_id: int, back: str
) -> tuple[list[Any], dict[str, Any] | None]:
    """The page's body (crumbs, summary, matrix, verdict table, loss-scale advice) and the
    readiness answer the trend chart is drawn from (None: nothing to draw)."""
    if client is None:
        return [html.H2(f"Run {run_id}: FP8 readiness")], None
    try:
        run = client.get_run(run_id)
        readiness = client.fp8_readiness(run_id)
        advice = client.loss_scale_advice(run_id)
    except RunNotFound:
        return [html.P(f"There is no run {run_id} on this collector.", className="error")], None
    except CollectorError as exc:
        return [html.P(str(exc), className="error")], None
    crumbs = html.Div(
        [dcc.Link(f"← {run.name}", href=back), html.Span(" / FP8 readiness", className="muted")],
        className="crumbs",
    )
    if readiness is None:
        return [
            crumbs,
            html.P("This collector has no FP8 readiness view.", className="muted"),
        ], None
    summary = ", ".join(f"{n} {VERDICT_LABELS[v]}" for v, n in readiness["summary"].items())
    declared = readiness.get("declared_recipe")
    children: list[Any] = [
        crumbs,
        html.H2(f"{run.name}: FP8 readiness"),
        html.P(
            [
                f"{summary}. ",
                f"Declared recipe: {declared}."
                if declared
                else "No FP8 recipe declared (watch(fp8_recipe=...)).",
            ]
        ),
        dcc.Graph(
            id=ids.FP8_MATRIX_GRAPH, config=GRAPH_CONFIG, figure=readiness_matrix_figure(readiness)
        ),
        _table(verdict_rows(readiness)),
    ]
    if advice is not None:
        children += [
            html.H3("Loss-scale advice (FP16)"),
            html.P(
                advice["why"]
                if not advice["applies"]
                else [
                    f"init_scale = {advice['init_scale']:g}, growth_interval = "
                    f"{advice['growth_interval']}: "
                    if advice["init_scale"]
                    else "",
                    advice["reason"],
                    f" (from {advice['steps_read']} of {advice['steps_sampled']} sampled steps)",
                ],
                id=ids.FP8_LOSS_SCALE_ADVICE,
            ),
            dcc.Graph(config=GRAPH_CONFIG, figure=loss_scale_figure(advice)),
        ]
    return children, readiness


def layout(
    run_id: int = 0, client: CollectorClient | None = None, back: str = "", **_kwargs: Any
) -> html.Div:
    body, readiness = fp8_view(client, run_id, back)
    recipes = list(readiness["recipes"]) if readiness else []
    chosen = (readiness or {}).get("declared_recipe") or "per_tensor"
    return html.Div(
        [
            dcc.Store(id=ids.FP8_RUN_ID, data=run_id),
            html.Div(id=ids.FP8_BODY, children=body),
            html.Div(
                [
                    dcc.Dropdown(
                        id=ids.FP8_TREND_RECIPE,
                        clearable=False,
                        value=chosen,
                        options=[{"label": r, "value": r} for r in recipes],
                    ),
                    dcc.Graph(
                        id=ids.FP8_TREND_GRAPH,
                        config=GRAPH_CONFIG,
                        figure=readiness_trend_figure(readiness)
                        if readiness
                        else readiness_trend_figure({"layers": [], "steps": []}),
                    ),
                ],
                style={} if readiness else {"display": "none"},
            ),
        ]
    )


def register_callbacks(app: dash.Dash, client: CollectorClient) -> None:
    @app.callback(
        Output(ids.FP8_TREND_GRAPH, "figure"),
        Input(ids.FP8_TREND_RECIPE, "value"),
        State(ids.FP8_RUN_ID, "data"),
        prevent_initial_call=True,
    )
    def trend(recipe: str, run_id: int) -> Any:
        try:
            readiness = client.fp8_readiness(int(run_id))
        except CollectorError:
            return dash.no_update
        return dash.no_update if readiness is None else readiness_trend_figure(readiness, recipe)
