"""Runs overview (`/`): every run with the numbers that say at a glance if it is healthy.

Columns: name (a link to the run), project, status, health (the worst firing alert), last
step, current loss scale, skip rate over the last ~1,024 steps, age of the last data. The
collector's list is fetched every few seconds into a store; filtering (text, health,
status) and sorting (click a header) happen on that store, without asking the collector.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import dash
from dash import ALL, Input, Output, State, ctx, dcc, html

from ampwatch.dashboard import ids
from ampwatch.dashboard.client import CollectorClient, CollectorError
from ampwatch.dashboard.figure_common import format_loss_scale
from ampwatch.dashboard.run_types import RunSummary
from ampwatch.dashboard.urls import compare_path, href, run_path

REFRESH_MS = 5_000
HEALTH_ORDER = {"ok": 0, "warning": 1, "critical": 2}
ANY = "any"


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    numeric: bool = False


COLUMNS = (
    Column("name", "run"),
    Column("project", "project"),
    Column("status", "status"),
    Column("health", "health"),
    Column("last_step", "last step", numeric=True),
    Column("loss_scale", "loss scale", numeric=True),
    Column("skip_rate", "skip rate", numeric=True),
    Column("age", "last data", numeric=True),
)
#: Worst health first; among equals the collector's order (newest first).
DEFAULT_SORT = {"column": "health", "descending": True}


def layout(**_kwargs: Any) -> html.Div:
    return html.Div(
        [
            html.Div(
                [
                    html.H2("Runs"),
                    dcc.Link(
                        "Compare runs →",
                        href=compare_path([]),
                        className="aside",
                        id="runs-compare-link",
                    ),
                ],
                className="title-row",
            ),
            dcc.Interval(id=ids.RUNS_REFRESH, interval=REFRESH_MS),
            dcc.Store(id=ids.RUNS_DATA),
            dcc.Store(id=ids.RUNS_SORT, data=DEFAULT_SORT),
            html.Div(
                [
                    dcc.Input(
                        id=ids.RUNS_FILTER_TEXT,
                        type="search",
                        debounce=False,
                        placeholder="filter by run or project name",
                    ),
                    dcc.Dropdown(
                        id=ids.RUNS_FILTER_HEALTH,
                        value=ANY,
                        clearable=False,
                        searchable=False,
                        options=[
                            {"label": "any health", "value": ANY},
                            *({"label": h, "value": h} for h in HEALTH_ORDER),
                        ],
                    ),
                    dcc.Dropdown(
                        id=ids.RUNS_FILTER_STATUS,
                        value=ANY,
                        clearable=False,
                        searchable=False,
                        options=[
                            {"label": "any status", "value": ANY},
                            {"label": "running", "value": "running"},
                            {"label": "ended", "value": "ended"},
                        ],
                    ),
                ],
                className="filters",
            ),
            html.Table(
                [
                    html.Thead(
                        html.Tr(
                            [
                                html.Th(
                                    html.Button(
                                        column.title,
                                        n_clicks=0,
                                        className="sort",
                                        id={"type": ids.RUNS_SORT_HEADER, "column": column.key},
                                    ),
                                    className="num" if column.numeric else None,
                                )
                                for column in COLUMNS
                            ]
                        )
                    ),
                    html.Tbody(
                        id=ids.RUNS_TABLE,
                        children=html.Tr(html.Td("Loading runs…", colSpan=len(COLUMNS))),
                    ),
                ],
                className="runs",
            ),
        ]
    )


def age_seconds(run: RunSummary, now: datetime) -> float:
    try:
        seen = datetime.fromisoformat(run.last_seen_at)
    except ValueError:
        return math.inf
    if seen.tzinfo is None:
        seen = seen.replace(tzinfo=timezone.utc)
    return max((now - seen).total_seconds(), 0.0)


def format_age(seconds: float) -> str:
    """How long ago, in the largest whole unit: '42 s ago', '5 min ago', '3 h ago', '2 d ago'.

    >>> format_age(42.4), format_age(300), format_age(3 * 3600 + 5), format_age(2.5 * 86400)
    ('42 s ago', '5 min ago', '3 h ago', '2 d ago')
    """
    if not math.isfinite(seconds):
        return "—"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return f"{int(seconds)} s ago"


def format_rate(rate: float | None) -> str:
    return "—" if rate is None else f"{rate:.1%}"


def health_badge(health: str) -> html.Span:
    return html.Span(health, className=f"badge health-{health}")


def sort_key(column: str, now: datetime) -> Callable[[RunSummary], Any]:
    """The value of `column` to sort on; None when the run has none (sorted last)."""

    def key(run: RunSummary) -> Any:
        value: Any = {
            "name": run.name.lower(),
            "project": run.project.lower(),
            "status": run.status,
            "health": HEALTH_ORDER.get(run.health, 0),
            "last_step": run.last_step,
            "loss_scale": run.last_loss_scale,
            "skip_rate": run.skip_rate,
            "age": age_seconds(run, now),
        }[column]
        if isinstance(value, float) and math.isnan(value):
            value = None
        return value

    return key


def select_runs(
    runs: list[RunSummary],
    *,
    text: str = "",
    health: str = ANY,
    status: str = ANY,
    sort: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> list[RunSummary]:
    """The runs that pass every filter, sorted by `sort` (missing values always last)."""
    now = now or datetime.now(timezone.utc)
    needle = text.strip().lower()
    chosen = [
        run
        for run in runs
        if (not needle or needle in run.name.lower() or needle in run.project.lower())
        and health in (ANY, run.health)
        and status in (ANY, run.status)
    ]
    sort = sort or DEFAULT_SORT
    key = sort_key(str(sort["column"]), now)
    present = [run for run in chosen if key(run) is not None]
    missing = [run for run in chosen if key(run) is None]
    return sorted(present, key=key, reverse=bool(sort["descending"])) + missing


def runs_rows(
    runs: list[RunSummary], run_href: Callable[[int], str], now: datetime | None = None
) -> list[html.Tr]:
    """The table's rows; `run_href` maps a run id to its page's URL (depends on the mount)."""
    now = now or datetime.now(timezone.utc)
    return [
        html.Tr(
            [
                html.Td(dcc.Link(run.name, href=run_href(run.id))),
                html.Td(run.project),
                html.Td(run.status, className=f"status-{run.status}"),
                html.Td(health_badge(run.health)),
                html.Td("—" if run.last_step is None else f"{run.last_step:,}", className="num"),
                html.Td(format_loss_scale(run.last_loss_scale), className="num"),
                html.Td(format_rate(run.skip_rate), className="num"),
                html.Td(format_age(age_seconds(run, now)), className="num", title=run.last_seen_at),
            ],
            className=f"row-{run.health}",
        )
        for run in runs
    ]


def message_row(text: str, class_name: str | None = None) -> html.Tr:
    return html.Tr(html.Td(text, colSpan=len(COLUMNS), className=class_name))


def register_callbacks(app: dash.Dash, client: CollectorClient) -> None:
    @app.callback(Output(ids.RUNS_DATA, "data"), Input(ids.RUNS_REFRESH, "n_intervals"))
    def fetch_runs(_n_intervals: int | None) -> dict[str, Any]:
        try:
            return {"runs": [run.to_json() for run in client.list_runs()]}
        except CollectorError as exc:
            return {"error": str(exc)}

    @app.callback(
        Output(ids.RUNS_SORT, "data"),
        Input({"type": ids.RUNS_SORT_HEADER, "column": ALL}, "n_clicks"),
        State(ids.RUNS_SORT, "data"),
        prevent_initial_call=True,
    )
    def sort_by(_clicks: list[int], sort: dict[str, Any]) -> dict[str, Any]:
        column = ctx.triggered_id["column"] if ctx.triggered_id else DEFAULT_SORT["column"]
        if sort and sort.get("column") == column:
            return {"column": column, "descending": not sort.get("descending")}
        # Worse-first for health and skip rate, newest-first for steps; A→Z for names.
        return {"column": column, "descending": column in ("health", "skip_rate", "last_step")}

    @app.callback(
        Output({"type": ids.RUNS_SORT_HEADER, "column": ALL}, "children"),
        Input(ids.RUNS_SORT, "data"),
    )
    def sort_marks(sort: dict[str, Any]) -> list[str]:
        mark = " ▼" if sort.get("descending") else " ▲"
        return [c.title + (mark if c.key == sort.get("column") else "") for c in COLUMNS]

    @app.callback(
        Output(ids.RUNS_TABLE, "children"),
        Input(ids.RUNS_DATA, "data"),
        Input(ids.RUNS_FILTER_TEXT, "value"),
        Input(ids.RUNS_FILTER_HEALTH, "value"),
        Input(ids.RUNS_FILTER_STATUS, "value"),
        Input(ids.RUNS_SORT, "data"),
    )
    def render_runs(
        data: dict[str, Any] | None,
        text: str | None,
        health: str | None,
        status: str | None,
        sort: dict[str, Any] | None,
    ) -> Any:
        if data is None:
            return message_row("Loading runs…")
        if "error" in data:
            return message_row(data["error"], "error")
        runs = [RunSummary.from_json(r) for r in data["runs"]]
        if not runs:
            return message_row(
                "No runs yet. Attach the ampwatch agent to a training loop "
                "and its run appears here."
            )
        shown = select_runs(
            runs, text=text or "", health=health or ANY, status=status or ANY, sort=sort
        )
        if not shown:
            return message_row(f"No run matches the filters ({len(runs)} runs in all).")
        return runs_rows(shown, lambda run_id: href(app, run_path(run_id)))
