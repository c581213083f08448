"""Downsampled reads over real HTTP: spikes, NaN and every skipped step survive; bucket
extremes equal a direct computation; a frozen layer stays visible in the heatmap."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
from wire_batches import make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH, decode_float
from ampwatch.server.schemas.wire import MAX_BATCH_RECORDS

N_STEPS = 100_000
SPIKE_STEP = 54_321
NAN_STEP = 77_777
SKIPPED = sorted({(i * 7_919) % N_STEPS + 1 for i in range(37)} | {64, 65, 99_999})


def post(client: httpx.Client, batch: Any) -> httpx.Response:
    body = gzip.compress(json.dumps(batch).encode(), compresslevel=1)
    response = client.post(INGEST_PATH, content=body, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 200, response.text
    return response


def decoded(values: list[Any]) -> np.ndarray:
    return np.array([math.nan if v is None else decode_float(v) for v in values], dtype=float)


@dataclass(frozen=True)
class LongRun:
    client: httpx.Client
    run_id: int
    loss: np.ndarray


@pytest.fixture(scope="module")
def long_run(module_collector: Any) -> Iterator[LongRun]:
    """100,000 steps of random loss with one spike, one NaN and sparse skipped steps,
    stored once per backend: the tests that use it only read."""
    rng = np.random.default_rng(4)
    loss = rng.random(N_STEPS) + 1.0
    loss[SPIKE_STEP - 1] = 1e6
    loss[NAN_STEP - 1] = math.nan
    skipped = set(SKIPPED)
    run_id = 0
    with httpx.Client(base_url=module_collector.url, timeout=30) as client:
        for seq, first in enumerate(range(1, N_STEPS + 1, MAX_BATCH_RECORDS)):
            steps = [
                step_record(s, loss=float(loss[s - 1]), loss_scale=65536.0 / (1 + s % 3),
                            skipped=s in skipped)
                for s in range(first, min(first + MAX_BATCH_RECORDS, N_STEPS + 1))
            ]  # fmt: skip
            run_id = post(client, make_batch(seq, steps=steps)).json()["run_id"]
        yield LongRun(client, run_id, loss)


def buckets_of(series: dict[str, Any]) -> dict[int, list[int]]:
    """Point indices by bucket (step // bucket_width)."""
    out: dict[int, list[int]] = {}
    for i, step in enumerate(series["step"]):
        out.setdefault(step // series["bucket_width"], []).append(i)
    return out


def test_a_spike_a_nan_and_every_skipped_step_survive_100k_to_500(long_run: LongRun) -> None:
    client = long_run.client
    run_id = long_run.run_id
    series = client.get(f"/api/v1/runs/{run_id}/steps", params={"max_points": 500}).json()
    width = series["bucket_width"]
    assert 1 < len(series["step"]) <= 500
    assert 1e6 in series["loss"]
    assert "NaN" in series["loss"]
    assert sum(series["skipped_count"]) == len(SKIPPED)
    marked = {s // width for s, flag in zip(series["step"], series["skipped"]) if flag}
    assert marked == {s // width for s in SKIPPED}


def test_bucket_extremes_equal_a_direct_computation(long_run: LongRun) -> None:
    client = long_run.client
    run_id, loss = long_run.run_id, long_run.loss
    steps = np.arange(1, N_STEPS + 1)
    for params in ({"max_points": 500}, {"max_points": 300, "start": 12_345, "end": 67_890}):
        series = client.get(f"/api/v1/runs/{run_id}/steps", params=params).json()
        width = series["bucket_width"]
        low, high = params.get("start", 1), params.get("end", N_STEPS)
        values = decoded(series["loss"])
        for key, points in buckets_of(series).items():
            inside = (steps // width == key) & (steps >= low) & (steps <= high)
            direct = loss[inside]
            got = values[points]
            assert series["step"][points[0]] == steps[inside][0]
            assert series["step"][points[-1]] == steps[inside][-1]
            if np.isnan(direct).any():  # NaN wins the maximum; the minimum ignores it
                assert math.isnan(got[-1])
                assert got[0] == np.nanmin(direct)
            else:
                assert (got.min(), got.max()) == (direct.min(), direct.max())


def test_a_short_window_is_returned_exactly(long_run: LongRun) -> None:
    client = long_run.client
    run_id, loss = long_run.run_id, long_run.loss
    params = {"start": SPIKE_STEP - 5, "end": SPIKE_STEP + 5, "max_points": 100}
    series = client.get(f"/api/v1/runs/{run_id}/steps", params=params).json()
    assert series["bucket_width"] == 1
    assert series["step"] == list(range(SPIKE_STEP - 5, SPIKE_STEP + 6))
    assert series["loss"] == loss[SPIKE_STEP - 6 : SPIKE_STEP + 5].tolist()


def _layer_batch(seq: int, steps: range, names: list[str], values: np.ndarray) -> Any:
    return make_batch(
        seq,
        client_run_id="layers",
        layer_stats=[
            {"step": step, "rank": 0, "names": names,
             "stats": {"zero_fraction": values[i].tolist()}}
            for i, step in enumerate(steps)
        ],
    )  # fmt: skip


def test_heatmap_downsampling_keeps_a_frozen_layer_visible(client: httpx.Client) -> None:
    n_samples, n_layers = 2000, 50
    names = [f"blocks.{i}.weight" for i in range(n_layers)]
    rng = np.random.default_rng(1)
    values = rng.random((n_samples, n_layers)) * 0.5
    values[1234:1240, 17] = 1.0  # frozen for 6 samples (60 steps) out of 2000
    steps = range(10, 10 * n_samples + 1, 10)
    run_id = post(client, _layer_batch(0, steps, names, values)).json()["run_id"]

    params = {"stat": "zero_fraction", "max_steps": 100, "max_layers": 10}
    matrix = client.get(f"/api/v1/runs/{run_id}/layers", params=params).json()
    assert len(matrix["steps"]) <= 100 and len(matrix["layers"]) == 10
    step_width, layer_width = matrix["step_width"], matrix["layer_width"]
    assert layer_width == 5 and matrix["layers"][3] == "blocks.15.weight"
    got = np.array(matrix["values"])
    assert got.max() == 1.0
    frozen_row = matrix["steps"].index(next(
        s for s in matrix["steps"] if s // step_width == 12_350 // step_width
    ))  # fmt: skip
    assert got[frozen_row, 3] == 1.0  # layer 17 is in the 4th group of 5
    # Every cell is the max over its step bucket and layer group.
    keys = np.array(steps) // step_width
    for i, first_step in enumerate(matrix["steps"]):
        rows = keys == first_step // step_width
        for j in range(len(matrix["layers"])):
            cell = values[rows, j * layer_width : (j + 1) * layer_width]
            assert got[i, j] == cell.max()


def test_one_layer_series_downsampled_and_exact(client: httpx.Client) -> None:
    n_samples, names = 3000, ["a.weight", "b/odd name.weight"]
    rng = np.random.default_rng(2)
    values = rng.random((n_samples, 2))
    values[2000, 1] = 7.5  # a spike in the second layer only
    steps = range(1, n_samples + 1)
    run_id = post(client, _layer_batch(0, steps, names, values)).json()["run_id"]
    path = f"/api/v1/runs/{run_id}/layers/b/odd name.weight/series"

    exact = client.get(path, params={"stat": "zero_fraction", "max_points": 5000}).json()
    assert exact["bucket_width"] == 1
    assert exact["value"] == values[:, 1].tolist()
    small = client.get(path, params={"stat": "zero_fraction", "max_points": 100}).json()
    assert len(small["step"]) <= 100 and 7.5 in small["value"]
    width = small["bucket_width"]
    got = np.array(small["value"])
    for key in {s // width for s in small["step"]}:
        points = [i for i, s in enumerate(small["step"]) if s // width == key]
        direct = values[[s // width == key for s in steps], 1]
        assert (got[points].min(), got[points].max()) == (direct.min(), direct.max())
    missing = client.get(f"/api/v1/runs/{run_id}/layers/nope/series")
    assert missing.status_code == 404
    assert "no layer 'nope'" in missing.json()["detail"]


def test_layer_reads_keep_nan_inf_missing_and_windows(client: httpx.Client) -> None:
    """The heatmap and one layer's series read packed rows at driver level (PostgreSQL
    through a binary cursor): every cell comes back bit-exact, NaN and +-Inf as strings,
    a layer absent from a record (and the short rows written before it appeared) as null,
    and start/end windows are inclusive."""
    first = {"step": 10, "rank": 0, "names": ["a", "b"], "stats": {"zero_fraction": [0.1, "NaN"]}}
    second = {
        "step": 20,
        "rank": 0,
        "names": ["a", "c"],
        "stats": {"zero_fraction": ["Infinity", 5e-324]},
    }
    third = {
        "step": 30,
        "rank": 0,
        "names": ["b", "c"],
        "stats": {"zero_fraction": ["-Infinity", 1.0000000000000002]},
    }
    batch = make_batch(0, layer_stats=[first, second, third])
    run_id = post(client, batch).json()["run_id"]
    base = f"/api/v1/runs/{run_id}"

    matrix = client.get(f"{base}/layers", params={"stat": "zero_fraction"}).json()
    assert matrix["layers"] == ["a", "b", "c"] and matrix["steps"] == [10, 20, 30]
    assert matrix["values"] == [
        [0.1, "NaN", None], ["Infinity", None, 5e-324], [None, "-Infinity", 1.0000000000000002],
    ]  # fmt: skip
    window = client.get(
        f"{base}/layers", params={"stat": "zero_fraction", "start": 20, "end": 30}
    ).json()
    assert window["steps"] == [20, 30] and window["values"] == matrix["values"][1:]
    assert client.get(f"{base}/layers", params={"stat": "flush_fraction"}).json()["steps"] == []

    for layer, column in (("a", 0), ("b", 1), ("c", 2)):
        got = client.get(f"{base}/layers/{layer}/series", params={"stat": "zero_fraction"})
        assert got.json()["step"] == [10, 20, 30]
        assert got.json()["value"] == [row[column] for row in matrix["values"]]
    ends = client.get(
        f"{base}/layers/c/series", params={"stat": "zero_fraction", "start": 11, "end": 20}
    ).json()
    assert ends["step"] == [20] and ends["value"] == [5e-324]


def test_histograms_at_a_step_and_over_steps(client: httpx.Client) -> None:
    record = {
        "step": 10, "rank": 0, "names": ["w", "b"],
        "stats": {"zero_fraction": [0.0, 0.5]},
        "exponent_histograms": {"offsets": [100, 0], "counts": [[3, 0, 2**40], [7]]},
    }  # fmt: skip
    later = {
        **record,
        "step": 20,
        "exponent_histograms": {"offsets": [90, 255], "counts": [[1], [2]]},
    }
    run_id = post(client, make_batch(0, layer_stats=[record, later])).json()["run_id"]
    path = f"/api/v1/runs/{run_id}/layers/w/histograms"
    assert client.get(path, params={"step": 10}).json() == {
        "layer": "w", "rank": 0, "steps": [10], "offsets": [100], "counts": [[3, 0, 2**40]],
        "loss_scale": [None],  # no step record was sent
    }  # fmt: skip
    both = client.get(path).json()
    assert both["steps"] == [10, 20] and both["offsets"] == [100, 90]
    assert client.get(path, params={"max_points": 1}).json()["steps"] == [10]
    assert client.get(f"/api/v1/runs/{run_id}/layers/b/histograms").json()["counts"] == [
        [7], [2],
    ]  # fmt: skip


def test_histograms_carry_the_loss_scale_of_their_step(client: httpx.Client) -> None:
    """Exact at each sampled step (the steps between them halved the scale), from the
    rank's own step record where it sent one, else rank 0's."""
    steps = [step_record(s, loss_scale=2.0 ** (20 - s)) for s in range(1, 21)]
    steps.append(step_record(20, rank=1, loss_scale=math.inf))
    records = [
        {"step": s, "rank": rank, "names": ["w"], "stats": {"zero_fraction": [0.0]},
         "exponent_histograms": {"offsets": [100], "counts": [[1]]}}
        for s in (5, 20, 30) for rank in (0, 1)
    ]  # fmt: skip
    run_id = post(client, make_batch(0, steps=steps, layer_stats=records)).json()["run_id"]
    path = f"/api/v1/runs/{run_id}/layers/w/histograms"
    assert client.get(path).json()["loss_scale"] == [32768.0, 1.0, None]
    assert client.get(path, params={"rank": 1}).json()["loss_scale"] == [32768.0, "Infinity", None]


@pytest.mark.parametrize(
    ("histograms", "message"),
    [
        ({"offsets": [250], "counts": [[1] * 7]}, "passes bin 255"),
        ({"offsets": [0], "counts": [[-1]]}, ">= 0"),
        ({"offsets": [0], "counts": [[1.5]]}, "arrays of integers"),
        ({"offsets": [256], "counts": [[1]]}, "less than 256"),
        ({"offsets": [0, 1], "counts": [[1], [1]]}, "2 histograms for 1 names"),
    ],
)
def test_invalid_histograms_are_422(
    client: httpx.Client, histograms: dict[str, Any], message: str
) -> None:
    record = {"step": 1, "rank": 0, "names": ["w"], "stats": {},
              "exponent_histograms": histograms}  # fmt: skip
    response = client.post(INGEST_PATH, content=json.dumps(make_batch(0, layer_stats=[record])))
    assert response.status_code == 422
    assert message in response.text


def test_checkpoints_and_dropped_counts(client: httpx.Client) -> None:
    events = [
        {"kind": "checkpoint", "step": 100, "time": 10.0, "data": {"path": "/ckpt/100.pt"}},
        {"kind": "finding", "step": 5, "time": 5.0, "data": {"code": "bf16_in_use"}},
        {"kind": "checkpoint", "step": 200, "time": 20.0, "data": {}},
    ]
    first = {**make_batch(0, events=events), "dropped": {"steps": 3, "layer_stats": 1}}
    run_id = post(client, first).json()["run_id"]
    post(client, {**make_batch(1), "dropped": {"steps": 2, "events": 4}})
    assert client.get(f"/api/v1/runs/{run_id}/checkpoints").json() == {
        "checkpoints": [
            {"step": 100, "time": 10.0, "path": "/ckpt/100.pt", "data": {"path": "/ckpt/100.pt"}},
            {"step": 200, "time": 20.0, "path": None, "data": {}},
        ]
    }
    run = client.get(f"/api/v1/runs/{run_id}").json()
    assert run["dropped"] == {"steps": 5, "layer_stats": 1, "events": 4}
    bad = client.post(INGEST_PATH, content=json.dumps({**make_batch(2), "dropped": {"x": 1}}))
    assert bad.status_code == 422 and "unknown dropped kind" in bad.text


def test_out_of_order_sequence_numbers_are_all_applied_once(client: httpx.Client) -> None:
    acks = [post(client, make_batch(seq, steps=[step_record(seq + 1, loss=float(seq))])).json()
            for seq in (2, 0, 1, 2)]  # fmt: skip
    assert [ack["duplicate"] for ack in acks] == [False, False, False, True]
    series = client.get(f"/api/v1/runs/{acks[0]['run_id']}/steps").json()
    assert series["step"] == [1, 2, 3] and series["loss"] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/steps", {"max_points": 1}),
        ("/steps", {"start": -1}),
        ("/layers", {"max_steps": 0}),
        ("/layers/w/series", {"stat": "nope"}),
    ],
)
def test_bad_query_parameters_are_422(
    client: httpx.Client, path: str, params: dict[str, Any]
) -> None:
    run_id = post(client, make_batch(0, steps=[step_record(1)])).json()["run_id"]
    post(
        client,
        make_batch(
            1,
            layer_stats=[{"step": 1, "rank": 0, "names": ["w"], "stats": {"zero_fraction": [0.0]}}],
        ),
    )
    assert client.get(f"/api/v1/runs/{run_id}{path}", params=params).status_code == 422
