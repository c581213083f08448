"""Run page (`/run/<id>`): is every layer still learning, is the scale healthy, where to restart.

Charts: loss scale (log2, the scale lines the run's rules judge by, skipped steps,
checkpoints with the advisor's verdicts) over the loss; skip rate; gradient norm;
final-layer activation norm with activation_norm_spike's own threshold; a layers × steps heatmap (zero-gradient fraction, FP16-subnormal share or
flush-to-zero forecast; click a row for the layer's page); the alerts as a timeline with
their explanations; the checkpoints with the restart advisor's verdicts. After a resume
from a plan (`watch(resume_from=)`), the loss, loss-scale and grad-norm charts draw the
abandoned tail greyed under the new branch (`step_figures.abandoned_traces`).

Data flow: the page comes drawn with its data (`layout(run_id, client)`, in the app's
initial layout or from the router), then three callbacks:
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

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import dash
import plotly.graph_objects as go
from dash import Input, Output, Patch, State, ctx, dcc, html
from dash.exceptions import PreventUpdate

from ampwatch.dashboard import (
    alert_figures,
    figure_common,
    heatmap_figures,
    ids,
    loss_scale_figures,
    step_figures,
)
from ampwatch.dashboard.client import (
    HEATMAP_STEPS,
    STEP_POINTS,
    CollectorClient,
    CollectorError,
    RunNotFound,
)
from ampwatch.dashboard.pages.runs import age_seconds, format_age, format_rate, health_badge
from ampwatch.dashboard.run_types import Alert, RestartAdvice, RunEvent, RunSummary
from ampwatch.dashboard.series_types import STEP_COLUMNS, AbandonedTail, LayerMatrix, StepSeries
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
#: Alerts drawn (timeline rows and explanations); the others are counted per rule.
SHOWN_ALERTS = 30
#: Heatmap cells kept in the browser's store to this many decimals (shares in [0, 1]).
HEATMAP_DECIMALS = 4
#: Refetch from scratch once the appended tail holds this many times the first answer.
COMPACT_FACTOR = 2
X_RANGE_KEY = re.compile(r"^xaxis\d*\.range(\[[01]\])?$")
X_AUTORANGE_KEY = re.compile(r"^xaxis\d*\.autorange$")


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


def _optional(value: Any) -> Any:
    return None if value is None else value.to_json()


def select_alerts(
    alerts: list[Alert], limit: int = SHOWN_ALERTS
) -> tuple[list[Alert], dict[str, int]]:
    """The `limit` alerts that matter most -- firing before pending before resolved,
    critical first, run-wide before per-layer, latest first -- and a count per rule of the
    others. A model-wide risk can fire once per layer (500 alerts); the page shows the
    worst and says how many more there are, instead of a 20,000-pixel timeline.

    >>> shown, hidden = select_alerts([], 3)
    >>> shown, hidden
    ([], {})
    """
    status = {"firing": 0, "pending": 1, "resolved": 2}
    severity = {"critical": 0, "warning": 1, "info": 2}
    ranked = sorted(
        alerts,
        key=lambda a: (
            status.get(a.status, 3),
            severity.get(a.severity, 3),
            a.layer is not None,
            -(a.fired_step or a.started_step or 0),
        ),
    )
    hidden: dict[str, int] = {}
    for alert in ranked[limit:]:
        hidden[alert.rule] = hidden.get(alert.rule, 0) + 1
    return ranked[:limit], hidden


def alerts_json(alerts: list[Alert] | None) -> dict[str, Any] | None:
    """The store's alerts: the shown ones and the hidden ones' counts (None: no engine)."""
    if alerts is None:
        return None
    shown, hidden = select_alerts(alerts)
    return {"shown": [a.to_json() for a in shown], "hidden": hidden}


def fetch_run_data(
    client: CollectorClient, run_id: int, stat: str = "zero_fraction"
) -> dict[str, Any]:
    """Everything the run page draws, as JSON for the store; `error` set instead on failure.

    The seven reads go out together (the collector serves requests from a thread pool), so
    the first render waits for the slowest of them, the heatmap, rather than their sum.
    """
    reads: dict[str, Callable[[], Any]] = {
        "run": lambda: client.get_run(run_id),
        "steps": lambda: client.steps(run_id),
        "heatmap": lambda: client.layer_matrix(run_id, stat),
        "events": lambda: client.events(run_id),
        "layers": lambda: client.layer_names(run_id),
        "alerts": lambda: client.alerts(run_id),
        "advice": lambda: client.restart_candidates(run_id),
        "abandoned": lambda: client.abandoned_steps(run_id),
    }
    try:
        with ThreadPoolExecutor(max_workers=len(reads)) as pool:
            futures = {name: pool.submit(read) for name, read in reads.items()}
            answers = {name: future.result() for name, future in futures.items()}
        run, steps, heatmap, events, layers, alerts, advice, abandoned = answers.values()
    except RunNotFound:
        return {"error": f"There is no run {run_id} on this collector."}
    except CollectorError as exc:
        return {"error": str(exc)}
    return {
        "run_id": run_id,
        "run": run.to_json(),
        "steps": steps.to_json(),
        "heatmap": heatmap.to_json(decimals=HEATMAP_DECIMALS),
        "heatmap_next": heatmap.next_step,
        "events": [event.to_json() for event in events],
        "layers": layers,
        "alerts": alerts_json(alerts),
        "advice": _optional(advice),
        "abandoned": [tail.to_json() for tail in abandoned],
    }


def resumes_in(events: list[dict[str, Any]]) -> int:
    """The run's `resumed` events: a new one moved the steps after its checkpoint aside on
    the collector, so the stored series is read again whole (`update_run_data`)."""
    return sum(1 for event in events if event["kind"] == "resumed")


def cursor_of(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """Where the stored data ends, the little the refresh needs to know: it is sent to the
    server every tick, the data itself only when the charts must be redrawn."""
    if data is None or "error" in data:
        return None
    steps, heatmap = data["steps"], data["heatmap"]
    return {
        "run_id": data["run_id"],
        "run": data["run"],
        "stat": heatmap.get("stat"),
        "layers": heatmap["layers"],
        "last_step": steps["step"][-1] if steps["step"] else None,
        "points": len(steps["step"]),
        "rows": len(heatmap["steps"]),
        "heatmap_next": data.get("heatmap_next"),
        "heatmap_width": heatmap.get("step_width", 1),
        "resumes": resumes_in(data["events"]),
    }


Update = tuple[Any, Any]  # (the data store's new value or Patch, the new cursor)


def _replaced(data: dict[str, Any]) -> Update:
    return data, cursor_of(data)


def update_run_data(
    client: CollectorClient, run_id: int, cursor: dict[str, Any], stat: str
) -> Update:
    """What changed since `cursor` (`cursor_of` the stored data), and the new cursor: a
    `Patch` appending new steps and heatmap rows and replacing the small parts;
    `no_update` when nothing changed; a full fetch when the stored series has grown too
    long to stay downsampled; an error to show."""
    too_long = (
        cursor["points"] > COMPACT_FACTOR * STEP_POINTS
        or cursor["rows"] > COMPACT_FACTOR * HEATMAP_STEPS
    )
    if too_long:
        return _replaced(fetch_run_data(client, run_id, stat))
    if cursor["stat"] != stat:  # another statistic picked: only the heatmap changes
        try:
            matrix = client.layer_matrix(run_id, stat)
        except CollectorError as exc:
            return _replaced({"error": str(exc)})
        patch = Patch()
        patch["heatmap"] = matrix.to_json(decimals=HEATMAP_DECIMALS)
        patch["heatmap_next"] = matrix.next_step
        return patch, {
            **cursor,
            "stat": stat,
            "layers": matrix.layers,
            "rows": len(matrix.steps),
            "heatmap_next": matrix.next_step,
            "heatmap_width": matrix.step_width,
        }
    # A downsampled series' last point is its last bucket's last step; a heatmap row
    # starts its bucket, so the store keeps where the next rows begin.
    last_step = cursor["last_step"]
    try:
        run = client.get_run(run_id)
        if run.to_json() == cursor["run"]:
            # No batch arrived and no alert moved the run's health.
            return dash.no_update, dash.no_update
        new_steps = client.steps(run_id, start=None if last_step is None else last_step + 1)
        new_rows = client.layer_matrix(run_id, stat, start=cursor["heatmap_next"])
        # New layers appeared (the columns changed), or the new rows came in wider buckets
        # than the stored ones (a long backlog; they would leave gaps between the stored
        # buckets): the whole matrix is read again.
        whole = bool(new_rows.steps) and (
            new_rows.layers != cursor["layers"]
            or new_rows.step_width > cursor.get("heatmap_width", 1)
        )
        if whole:
            new_rows = client.layer_matrix(run_id, stat)
        events = client.events(run_id)
        if resumes_in([event.to_json() for event in events]) != cursor.get("resumes", 0):
            # Resumed from a plan: the stored tail after its checkpoint is abandoned.
            return _replaced(fetch_run_data(client, run_id, stat))
        alerts = client.alerts(run_id)
        advice = client.restart_candidates(run_id)
    except RunNotFound:
        return _replaced({"error": f"There is no run {run_id} on this collector."})
    except CollectorError as exc:
        return _replaced({"error": str(exc)})
    patch = Patch()
    patch["run"] = run.to_json()
    moved: dict[str, Any] = {"run": run.to_json()}
    new = new_steps.to_json()
    if last_step is None:
        patch["steps"] = new
    elif new_steps.step:
        for name in STEP_COLUMNS:
            patch["steps"][name].extend(new[name])
        patch["steps"]["rule_lines"] = new["rule_lines"]  # an override may have moved them
    if new_steps.step:
        moved.update(
            last_step=new_steps.step[-1],
            points=(cursor["points"] if last_step is not None else 0) + len(new_steps.step),
        )
    if new_rows.steps and not whole:
        patch["heatmap"]["steps"].extend(new_rows.steps)
        patch["heatmap"]["values"].extend(new_rows.to_json(decimals=HEATMAP_DECIMALS)["values"])
        patch["heatmap_next"] = new_rows.next_step
        moved.update(rows=cursor["rows"] + len(new_rows.steps), heatmap_next=new_rows.next_step)
    elif new_rows.steps:
        patch["heatmap"] = new_rows.to_json(decimals=HEATMAP_DECIMALS)
        patch["heatmap_next"] = new_rows.next_step
        moved.update(
            rows=len(new_rows.steps),
            heatmap_next=new_rows.next_step,
            layers=new_rows.layers,
            heatmap_width=new_rows.step_width,
        )
    patch["events"] = [event.to_json() for event in events]
    patch["alerts"] = alerts_json(alerts)
    patch["advice"] = _optional(advice)
    return patch, {**cursor, **moved}


def zoom_window(relayout: dict[str, Any] | None) -> tuple[int, int] | bool | None:
    """The x window a relayout event asks for: (start, end) steps, None for "zoom out"
    (autorange), False when the event is not about the x axis (resize, y zoom).

    >>> zoom_window({"xaxis.range[0]": 10.4, "xaxis.range[1]": 99.6})
    (10, 100)
    >>> zoom_window({"xaxis2.autorange": True}), zoom_window({"autosize": True})
    (None, False)
    """
    if not relayout:
        return False
    if any(X_AUTORANGE_KEY.match(key) for key in relayout):
        return None
    bounds: list[float] = []
    for key, value in relayout.items():
        if X_RANGE_KEY.match(key):
            bounds += value if isinstance(value, list) else [value]
    if len(bounds) != 2:
        return False
    low, high = sorted(float(b) for b in bounds)
    return max(int(low), 0), round(high)


def fetch_zoom(
    client: CollectorClient, run_id: int, window: tuple[int, int], stat: str
) -> dict[str, Any]:
    start, end = window
    try:
        steps = client.steps(run_id, start=start, end=end)
        heatmap = client.layer_matrix(run_id, stat, start=start, end=end)
    except CollectorError as exc:
        return {"error": str(exc)}
    return {
        "start": start,
        "end": end,
        "steps": steps.to_json(),
        "heatmap": heatmap.to_json(decimals=HEATMAP_DECIMALS),
    }


def run_header(run: RunSummary) -> html.Div:
    facts = [
        ("project", run.project),
        ("status", run.status),
        ("last step", "—" if run.last_step is None else f"{run.last_step:,}"),
        ("loss scale", figure_common.format_loss_scale(run.last_loss_scale)),
        ("skip rate (last ~1k steps)", format_rate(run.skip_rate)),
        ("skipped steps", f"{run.skipped_steps:,}"),
        ("last data", format_age(age_seconds(run, datetime.now(timezone.utc)))),
    ]
    return html.Div(
        [
            html.Div([html.H2(run.name), health_badge(run.health)], className="title-row"),
            html.Dl(
                # One group per fact, so a wrapping line never parts a label from its value.
                [html.Div([html.Dt(label), html.Dd(value)]) for label, value in facts],
                className="facts",
                title=f"last data {figure_common.format_time(run.last_seen_at)}",
            ),
        ]
    )


def hidden_note(hidden: dict[str, int]) -> str:
    """'and 470 more: underflow_risk × 468, skip_rate × 2' (empty when nothing is hidden)."""
    if not hidden:
        return ""
    rules = ", ".join(f"{rule} × {n}" for rule, n in sorted(hidden.items(), key=lambda i: -i[1]))
    return f"and {sum(hidden.values()):,} more: {rules}"


def alerts_list(alerts: list[Alert] | None, hidden: dict[str, int] | None = None) -> html.Div:
    """Each alert with what it says and the values that triggered it, in `select_alerts`
    order, then how many more there are."""
    if alerts is None:
        return html.Div(html.P("Alerts are not available on this collector.", className="muted"))
    items = []
    for alert in alerts:
        steps = " → ".join(
            f"{label} {step:,}"
            for label, step in (
                ("started", alert.started_step),
                ("fired", alert.fired_step),
                ("resolved", alert.resolved_step),
            )
            if step is not None
        )
        values = ", ".join(f"{k} = {v}" for k, v in alert.values.items())
        items.append(
            html.Li(
                [
                    html.Span(alert.severity, className=f"badge health-{alert.severity}"),
                    html.Span(alert.status, className=f"badge status-{alert.status}"),
                    html.B(alert_figures.alert_label(alert)),
                    html.Span(f" ({steps})" if steps else "", className="muted"),
                    html.Div(alert.message, className="message"),
                    html.Div(values, className="values muted") if values else None,
                ],
                className=f"alert alert-{alert.status}",
            )
        )
    note = hidden_note(hidden or {})
    return html.Div(
        [
            html.Ul(items, className="alerts") if items else None,
            html.P(note, className="muted") if note else None,
        ]
    )


def checkpoints_table(advice: RestartAdvice | None, events: list[RunEvent]) -> html.Div:
    """The advisor's candidates with verdicts and reasons, the recommended one highlighted;
    without an advisor, the checkpoints the agent reported."""
    if advice is None:
        reported = [e for e in events if e.kind == "checkpoint"]
        note = html.P(
            "The restart advisor is not available on this collector; these are the "
            "checkpoints the agent reported.",
            className="muted",
        )
        if not reported:
            return html.Div([note, html.P("No checkpoint reported yet.")])
        rows = [
            html.Tr(
                [
                    html.Td("—" if e.step is None else f"{e.step:,}", className="num"),
                    html.Td(str(e.data.get("path", ""))),
                ]
            )
            for e in reported
        ]
        return html.Div(
            [
                note,
                html.Table(
                    [html.Thead(html.Tr([html.Th("step"), html.Th("path")])), html.Tbody(rows)],
                    className="runs",
                ),
            ]
        )
    summary = []
    if advice.recommended_step is not None:
        summary.append(
            html.Span(f"Restart from step {advice.recommended_step:,}.", className="recommend")
        )
    else:
        summary.append(
            html.Span("No checkpoint qualifies as a healthy restart point.", className="error")
        )
    if advice.onset_step is not None:
        summary.append(
            html.Span(
                f" Incident onset at step {advice.onset_step:,}"
                + (f" ({advice.onset_rule})" if advice.onset_rule else "")
                + (f"; margin {advice.margin_steps:,} steps." if advice.margin_steps else ".")
            )
        )
    if not advice.candidates:
        return html.Div([html.P(summary), html.P("No checkpoint reported yet.")])
    header = html.Thead(
        html.Tr([html.Th(t) for t in ("step", "verdict", "why", "loss scale", "act norm", "path")])
    )
    rows = [
        html.Tr(
            [
                html.Td("—" if c.step is None else f"{c.step:,}", className="num"),
                html.Td(
                    ("★ " if c.verdict == loss_scale_figures.RECOMMENDED else "") + c.verdict,
                    className=f"verdict-{c.verdict}",
                ),
                html.Td("; ".join(c.reasons)),
                html.Td(figure_common.format_loss_scale(c.loss_scale), className="num"),
                html.Td("—" if c.act_norm is None else f"{c.act_norm:.4g}", className="num"),
                html.Td(c.path or ""),
            ],
            className=f"candidate-{c.verdict}",
        )
        for c in advice.candidates
    ]
    return html.Div(
        [html.P(summary), html.Table([header, html.Tbody(rows)], className="runs checkpoints")]
    )


def run_span(series: StepSeries) -> tuple[int, int] | None:
    return (series.step[0], series.step[-1]) if series.step else None


RunView = tuple[Any, ...]
HIDDEN = {"display": "none"}
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


def register_callbacks(app: dash.Dash, client: CollectorClient) -> None:
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
            return _replaced(fetch_run_data(client, run_id, stat))
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

    # In the browser, from the store's layer names: the dropdown indexes every option it is
    # given for its search when it mounts, 300 ms of the first render for 500 layers.
    app.clientside_callback(  # type: ignore[no-untyped-call]
        f"""function (search, data) {{
            const needle = (search || "").toLowerCase();
            return ((data && data.layers) || [])
                .filter(name => name.toLowerCase().includes(needle))
                .slice(0, {LAYER_OPTIONS}).map(name => ({{label: name, value: name}}));
        }}""",
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
