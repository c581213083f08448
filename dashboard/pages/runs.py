"""Runs list page (`/`): every run with the numbers that say at a glance if it is healthy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dash
from dash import Input, Output, dcc, html

from ampwatch.dashboard import ids
from ampwatch.dashboard.client import CollectorClient, CollectorError, RunSummary
from ampwatch.dashboard.figures import format_loss_scale, format_time
from ampwatch.dashboard.urls import href

REFRESH_MS = 5_000
COLUMNS = ("run", "project", "status", "last step", "loss scale", "skipped steps", "last seen")


def layout(**_kwargs: Any) -> html.Div:
    return html.Div(
        [
            html.H2("Runs"),
            dcc.Interval(id=ids.RUNS_REFRESH, interval=REFRESH_MS),
            html.Div(id=ids.RUNS_TABLE, children=html.P("Loading runs…")),
        ]
    )


def runs_table(runs: list[RunSummary], run_href: Callable[[int], str]) -> html.Table | html.P:
    """The runs table; `run_href` maps a run id to its page's URL (which depends on the mount)."""
    if not runs:
        return html.P(
            "No runs yet. Attach the ampwatch agent to a training loop and its run appears here."
        )
    header = html.Thead(html.Tr([html.Th(name) for name in COLUMNS]))
    rows = [
        html.Tr(
            [
                html.Td(dcc.Link(run.name, href=run_href(run.id))),
                html.Td(run.project),
                html.Td(run.status, className=f"status-{run.status}"),
                html.Td("—" if run.last_step is None else str(run.last_step), className="num"),
                html.Td(format_loss_scale(run.last_loss_scale), className="num"),
                html.Td(str(run.skipped_steps), className="num"),
                html.Td(format_time(run.last_seen_at)),
            ]
        )
        for run in runs
    ]
    return html.Table([header, html.Tbody(rows)], className="runs")


def register_callbacks(app: dash.Dash, client: CollectorClient) -> None:
    @app.callback(Output(ids.RUNS_TABLE, "children"), Input(ids.RUNS_REFRESH, "n_intervals"))
    def refresh_runs(_n_intervals: int | None) -> html.Table | html.P:
        try:
            runs = client.list_runs()
        except CollectorError as exc:
            return html.P(str(exc), className="error")
        return runs_table(runs, lambda run_id: href(app, f"/run/{run_id}"))
