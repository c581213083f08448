"""The run page after a resume from a plan: the abandoned tail greyed and the new branch
drawn normally on the loss, loss-scale and grad-norm charts, read from a real collector
over HTTP; a page open during the resume reads the run again whole."""

from __future__ import annotations

import json
from typing import Any

import dash
import httpx
import plotly.graph_objects as go

from ampwatch.agent.wire import INGEST_PATH, STEP_FLOAT_FIELDS, WIRE_VERSION, encode_float
from ampwatch.dashboard.client import CollectorClient
from ampwatch.dashboard.figure_common import ABANDONED_COLOR
from ampwatch.dashboard.pages.run import render_run
from ampwatch.dashboard.pages.run_store import cursor_of, fetch_run_data, update_run_data
from ampwatch.dashboard.step_figures import ABANDONED_TRACE

OLD_END, FROM_STEP, NEW_END = 60, 20, 40
OLD_SCALE, NEW_SCALE = 2.0**10, 2.0**14


def _old(step: int) -> float:
    return 2.0 + step / 10  # the diverging loss of the abandoned process


def _new(step: int) -> float:
    return 2.0 - step / 100


def _send(
    http: httpx.Client, stream: str, seq: int, steps: range, loss: Any, scale: float, **event: Any
) -> int:
    records = []
    for step in steps:
        floats = {"loss": loss(step), "loss_scale": scale, "grad_norm": loss(step) / 4}
        record: dict[str, Any] = {"step": step, "rank": 0, "skipped": False}
        record.update({f: encode_float(floats.get(f)) for f in STEP_FLOAT_FIELDS})
        records.append(record)
    batch = {
        "wire_version": WIRE_VERSION,
        "run": {"client_run_id": "resumed-run", "name": "gpt-small", "project": "default"},
        "stream": stream,
        "seq": seq,
        "steps": records,
        "layer_stats": [],
        "events": [{"time": 1.0, "data": {}, **event}] if event else [],
        "dropped": {},
    }
    answer = http.post(INGEST_PATH, content=json.dumps(batch))
    assert answer.status_code == 200, answer.text
    return int(answer.json()["run_id"])


def _trace(figure: go.Figure, name: str) -> Any:
    (trace,) = [t for t in figure.data if t.name == name]
    return trace


def test_the_abandoned_tail_is_greyed_under_the_new_branch(live_collector: Any) -> None:
    client = CollectorClient(live_collector.url)
    with httpx.Client(base_url=live_collector.url, timeout=30) as http:
        run_id = _send(http, "0a", 0, range(1, OLD_END + 1), _old, OLD_SCALE)
        cursor = cursor_of(fetch_run_data(client, run_id))  # the page, open before the resume
        assert cursor is not None and cursor["resumes"] == 0
        _send(
            http, "0b", 0, range(FROM_STEP + 1, NEW_END + 1), _new, NEW_SCALE,
            kind="resumed", step=FROM_STEP, data={"from_step": FROM_STEP},
        )  # fmt: skip

    # The open page's refresh sees the resume and reads the run again whole.
    data, moved = update_run_data(client, run_id, cursor, "zero_fraction")
    assert isinstance(data, dict) and moved["resumes"] == 1 and moved["last_step"] == NEW_END
    view = render_run(data)
    loss_scale, grad_norm = view[1], view[3]
    gone = list(range(FROM_STEP + 1, OLD_END + 1))
    live = list(range(1, NEW_END + 1))
    expected_loss = [_old(s) if s <= FROM_STEP else _new(s) for s in live]
    grey = ABANDONED_TRACE.format(from_step=FROM_STEP)

    greyed = [t for t in loss_scale.data if t.name == grey]
    assert len(greyed) == 2  # the scale (top) and the loss (bottom), one legend entry
    scale_tail, loss_tail = sorted(greyed, key=lambda t: t.yaxis or "y")
    for trace in (scale_tail, loss_tail):
        assert list(trace.x) == gone and trace.line.color == ABANDONED_COLOR
    assert list(scale_tail.y) == [OLD_SCALE] * len(gone) and scale_tail.showlegend
    assert loss_tail.yaxis == "y2" and list(loss_tail.y) == [_old(s) for s in gone]
    assert list(_trace(loss_scale, "loss").x) == live
    assert list(_trace(loss_scale, "loss").y) == expected_loss
    scale = _trace(loss_scale, "loss scale")
    assert list(scale.y) == [OLD_SCALE] * FROM_STEP + [NEW_SCALE] * (NEW_END - FROM_STEP)
    assert scale.line.color != ABANDONED_COLOR
    # Drawn under the live branch: listed first.
    assert loss_scale.data.index(scale_tail) < loss_scale.data.index(scale)

    norm_tail = _trace(grad_norm, grey)
    assert list(norm_tail.x) == gone and list(norm_tail.y) == [_old(s) / 4 for s in gone]
    norm = _trace(grad_norm, "grad norm (unscaled, before clipping)")
    assert list(norm.x) == live and list(norm.y) == [v / 4 for v in expected_loss]

    # Nothing new: the next tick changes nothing (the resume is known now).
    assert update_run_data(client, run_id, moved, "zero_fraction") == (
        dash.no_update,
        dash.no_update,
    )
