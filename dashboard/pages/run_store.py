"""The run page's stores: what it reads first (`fetch_run_data`: `RUN_DATA`, as API JSON,
so NaN survives), where that data ends (`cursor_of`: `RUN_CURSOR`, all a refresh sends
the server), what a refresh appends to it (`update_run_data`: a `Patch`), and a zoomed
window read again at full resolution (`zoom_window`, `fetch_zoom`: `RUN_ZOOM`).
`ampwatch.dashboard.pages.run` says when each runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dash
from dash import Patch

from ampwatch.dashboard.client import (
    HEATMAP_STEPS,
    STEP_POINTS,
    CollectorClient,
    CollectorError,
    RunNotFound,
)
from ampwatch.dashboard.run_types import Alert
from ampwatch.dashboard.series_types import STEP_COLUMNS

#: Alerts drawn (timeline rows and explanations); the others are counted per rule.
SHOWN_ALERTS = 30
#: Heatmap cells kept in the browser's store to this many decimals (shares in [0, 1]).
HEATMAP_DECIMALS = 4
#: Refetch from scratch once the appended tail holds this many times the first answer.
COMPACT_FACTOR = 2
X_RANGE_KEY = re.compile(r"^xaxis\d*\.range(\[[01]\])?$")
X_AUTORANGE_KEY = re.compile(r"^xaxis\d*\.autorange$")


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


def replaced(data: dict[str, Any]) -> Update:
    """The store replaced whole by `data`, and its cursor."""
    return data, cursor_of(data)


def _other_stat(client: CollectorClient, run_id: int, cursor: dict[str, Any], stat: str) -> Update:
    """Another statistic picked: only the heatmap changes, read whole."""
    try:
        matrix = client.layer_matrix(run_id, stat)
    except CollectorError as exc:
        return replaced({"error": str(exc)})
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
        return replaced(fetch_run_data(client, run_id, stat))
    if cursor["stat"] != stat:
        return _other_stat(client, run_id, cursor, stat)
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
            return replaced(fetch_run_data(client, run_id, stat))
        alerts = client.alerts(run_id)
        advice = client.restart_candidates(run_id)
    except RunNotFound:
        return replaced({"error": f"There is no run {run_id} on this collector."})
    except CollectorError as exc:
        return replaced({"error": str(exc)})
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
