from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from ampwatch.dashboard.client import CollectorClient, CollectorError, RunNotFound
from ampwatch.dashboard.run_types import RunSummary
from ampwatch.dashboard.series_types import LayerMatrix, StepSeries

RUN_ID = 7  # the run the `collector_transport` fixture serves

MakeTransport = Callable[..., httpx.MockTransport]


def client_for(transport: httpx.BaseTransport) -> CollectorClient:
    return CollectorClient("http://collector.test/", transport=transport)


def test_steps_decode_non_finite_strings_and_keep_nulls(
    collector_transport: MakeTransport,
) -> None:
    series = client_for(collector_transport()).steps(RUN_ID)
    assert series.step == [1, 2, 3, 4, 5, 6]
    assert series.loss[2] == math.inf
    assert series.loss[4] is not None and math.isnan(series.loss[4])
    assert series.act_norm_mean[3] == math.inf
    assert series.grad_norm[2] is None
    assert series.skipped == [False, False, True, False, True, False]


def test_store_shape_round_trips_nan_as_the_wire_string(steps_json: dict[str, Any]) -> None:
    """The store must keep NaN apart from null, which Dash's JSON encoder would not."""
    encoded = StepSeries.from_json(steps_json).to_json()
    assert encoded["loss"] == [2.5, 2.4, "Infinity", 2.2, "NaN", 2.0]
    assert encoded["grad_norm"][2] is None
    assert StepSeries.from_json(encoded).to_json() == encoded


def test_missing_step_column_reads_as_not_measured() -> None:
    series = StepSeries.from_json({"step": [1, 2], "loss_scale": [2.0, 1.0]})
    assert series.loss == [None, None]
    assert series.skipped == [False, False]


def test_layer_matrix_decodes_values(
    collector_transport: MakeTransport, layers_json: dict[str, Any]
) -> None:
    matrix = client_for(collector_transport()).layer_matrix(RUN_ID, "zero_fraction")
    assert matrix.layers == layers_json["layers"]
    assert matrix.values[0] == [0.01, 0.1, 1.0]
    assert math.isnan(matrix.values[1][1])  # type: ignore[arg-type]
    assert LayerMatrix.from_json(matrix.to_json()).to_json() == layers_json


def test_runs_and_events(collector_transport: MakeTransport) -> None:
    client = client_for(collector_transport())
    (run,) = client.list_runs()
    assert (run.id, run.name, run.last_loss_scale, run.skipped_steps) == (
        RUN_ID,
        "gpt-small",
        16384.0,
        2,
    )
    assert client.get_run(RUN_ID) == run
    assert [(e.kind, e.step) for e in client.events(RUN_ID)] == [
        ("run_start", None),
        ("checkpoint", 4),
    ]


def test_unknown_run_raises_run_not_found(collector_transport: MakeTransport) -> None:
    with pytest.raises(RunNotFound):
        client_for(collector_transport()).get_run(999)


def test_unreachable_collector_says_where_it_looked() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(CollectorError, match=r"http://collector.test.*is it running"):
        client_for(httpx.MockTransport(refuse)).list_runs()


def test_malformed_answer_is_a_collector_error(collector_transport: MakeTransport) -> None:
    transport = collector_transport(**{f"/api/v1/runs/{RUN_ID}/steps": {"step": ["x"]}})
    with pytest.raises(CollectorError, match="unexpected answer"):
        client_for(transport).steps(RUN_ID)


def test_server_error_is_a_collector_error() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(500, text="boom"))
    with pytest.raises(CollectorError, match="answered 500"):
        client_for(transport).list_runs()


def test_steps_window_is_sent_as_start_end_and_max_points(
    collector_transport: MakeTransport,
) -> None:
    transport = collector_transport()
    client_for(transport).steps(RUN_ID, start=10, end=20, max_points=500)
    client_for(transport).steps(RUN_ID)
    first, plain = transport.requests  # type: ignore[attr-defined]
    assert dict(first.url.params) == {"rank": "0", "start": "10", "end": "20", "max_points": "500"}
    assert "start" not in plain.url.params  # None leaves the collector's default


def test_alerts_and_advice_decode_the_contract(collector_transport: MakeTransport) -> None:
    client = client_for(collector_transport())
    alerts = client.alerts(RUN_ID)
    assert alerts is not None
    collapse, underflow = alerts
    assert collapse.layer is None  # '' from the collector: a run-level rule
    assert (collapse.rule, collapse.status, collapse.fired_step) == (
        "loss_scale_collapse",
        "firing",
        5,
    )
    assert underflow.layer == "head.weight" and underflow.resolved_step == 4
    advice = client.restart_candidates(RUN_ID)
    assert advice is not None and advice.recommended_step == 4
    assert [(c.step, c.verdict) for c in advice.candidates] == [(4, "recommended"), (6, "rejected")]
    assert advice.candidates[1].act_norm is not None and math.isnan(advice.candidates[1].act_norm)
    assert advice.to_json()["candidates"][1]["act_norm"] == "NaN"


def test_missing_alert_engine_or_advisor_reads_as_not_available(
    collector_transport: MakeTransport,
) -> None:
    run = f"/api/v1/runs/{RUN_ID}"
    client = client_for(collector_transport(missing=(f"{run}/alerts", f"{run}/restart-candidates")))
    assert client.alerts(RUN_ID) is None
    assert client.restart_candidates(RUN_ID) is None


def test_layer_reads_quote_the_name_and_decode(collector_transport: MakeTransport) -> None:
    transport = collector_transport()
    client = client_for(transport)
    series = client.layer_series(RUN_ID, "head.weight", "zero_fraction")
    assert series.step == [2, 4, 6] and math.isnan(series.value[2])  # type: ignore[arg-type]
    hists = client.layer_histograms(RUN_ID, "head.weight")
    assert hists.offsets == [100, 99, 0] and hists.counts[0] == [1, 2]
    assert hists.loss_scale == [65536.0, math.inf, None]
    assert client.layer_names(RUN_ID) == ["embed.weight", "blocks.0.mlp.fc1.weight", "head.weight"]
    names_request = transport.requests[-1]  # type: ignore[attr-defined]
    # A window past every step: the collector lists the columns and reads no row.
    assert names_request.url.params["start"] == str(2**63 - 1)
    with pytest.raises(RunNotFound):
        client.layer_series(RUN_ID, "a/b", "zero_fraction")
    assert transport.requests[-1].url.raw_path.startswith(  # type: ignore[attr-defined]
        f"/api/v1/runs/{RUN_ID}/layers/a%2Fb/series".encode()
    )


def test_run_summary_reads_health_and_skip_rate(run_json: dict[str, Any]) -> None:
    run = RunSummary.from_json({**run_json, "health": "critical", "skip_rate": 0.25})
    assert (run.health, run.skip_rate) == ("critical", 0.25)
    old_collector = RunSummary.from_json(run_json)  # before the fields existed
    assert (old_collector.health, old_collector.skip_rate) == ("ok", None)


def test_a_tagged_answer_is_asked_for_again_with_its_tag_and_a_304_reuses_it(
    steps_json: dict[str, Any],
) -> None:
    """The collector answers an unchanged run's polls with 304 (`server/api/conditional.py`):
    the client keeps the tagged bytes and decodes them again, for every viewer."""
    version = {"now": 1}
    sent: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("if-none-match"))
        tag = f'"v{version["now"]}"'
        if request.headers.get("if-none-match") == tag:
            return httpx.Response(304, headers={"ETag": tag})
        body = {**steps_json, "step": [s + 100 * version["now"] for s in steps_json["step"]]}
        return httpx.Response(200, json=body, headers={"ETag": tag})

    client = client_for(httpx.MockTransport(answer))
    first = client.steps(RUN_ID)
    first.step.clear()  # a caller may change what it got: the cache keeps bytes
    again = client.steps(RUN_ID)
    version["now"] = 2
    changed = client.steps(RUN_ID)
    assert sent == [None, '"v1"', '"v1"']
    assert again.step == [101, 102, 103, 104, 105, 106]
    assert again.loss[4] is not None and math.isnan(again.loss[4])
    assert changed.step == [201, 202, 203, 204, 205, 206]
    assert client.steps(RUN_ID, start=3).step == [201, 202, 203, 204, 205, 206]
    assert sent[-1] is None  # another URL: another answer
