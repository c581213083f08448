from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from ampwatch.dashboard.client import (
    CollectorClient,
    CollectorError,
    LayerMatrix,
    RunNotFound,
    StepSeries,
)

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
