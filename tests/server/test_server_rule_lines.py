"""The step series serves activation_norm_spike's own threshold and the run's rule lines,
resolved with its effective settings: what the charts draw is what the rules judge by."""

from __future__ import annotations

import json
import statistics
from typing import Any

import httpx
import numpy as np
from wire_batches import make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH, decode_float
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.incident import run_config

SPIKE = 120


def _steps(first: int, last: int, rng: np.random.Generator) -> list[Any]:
    return [
        step_record(s, loss=2.0, loss_scale=65536.0, lr=1e-3,
                    act_norm_mean=100.0 if s == SPIKE else 10.0 + float(rng.normal(0, 0.2)))
        for s in range(first, last + 1)
    ]  # fmt: skip


def _post(client: httpx.Client, batch: Any) -> int:
    answer = client.post(INGEST_PATH, content=json.dumps(batch))
    assert answer.status_code == 200, answer.text
    return int(answer.json()["run_id"])


def _threshold(before: list[float], min_ratio: float, z: float) -> float:
    """activation_norm_spike's threshold, computed here from its documented definition."""
    window = before[-128:]
    median = statistics.median(window)
    mad = 1.4826 * statistics.median(abs(v - median) for v in window)
    return min_ratio * median if mad == 0 else max(min_ratio * median, median + z * mad)


def test_the_served_threshold_is_the_rules_and_overrides_move_the_lines(
    client: httpx.Client, collector: Any
) -> None:
    rng = np.random.default_rng(7)
    start = {"kind": "run_start", "step": None, "time": 1_767_225_600.0,
             "data": {"rank": 0, "min_loss_scale": 0.5}}  # fmt: skip
    run_id = _post(client, make_batch(0, steps=_steps(1, 150, rng), events=[start]))
    rules = {"activation_norm_spike": {"min_ratio": 5.0, "z_threshold": 100.0},
             "loss_scale_collapse": {"min_scale": 4.0}}  # fmt: skip
    put = client.put(f"/api/v1/runs/{run_id}/alert-config", json={"rules": rules})
    assert put.status_code == 200, put.text
    _post(client, make_batch(1, steps=_steps(151, 250, rng)))

    raw = client.get(f"/api/v1/runs/{run_id}/steps", params={"max_points": 10_000}).json()
    values = [decode_float(v) for v in raw["act_norm_mean"]]
    thresholds = [decode_float(v) for v in raw["act_threshold"]]
    assert raw["bucket_width"] == 1 and raw["step"] == list(range(1, 251))
    # Judged from the 50th baseline value on (min_baseline_steps), each against the
    # finite values before it, with the settings in effect when its batch arrived.
    assert thresholds[:50] == [None] * 50
    for i in range(50, 250):
        ratio, z = (2.0, 10.0) if raw["step"][i] <= 150 else (5.0, 100.0)
        expected = _threshold(values[:i], ratio, z)
        assert abs(thresholds[i] - expected) <= 1e-9 * expected, (raw["step"][i], thresholds[i])
    assert np.median(thresholds[160:]) > 2 * np.median(thresholds[60:150])  # the override moved it
    above = [s for s, v, t in zip(raw["step"], values, thresholds, strict=True)
             if t is not None and v >= t]  # fmt: skip
    counted = [s for s, n in zip(raw["step"], raw["act_above_count"], strict=True) if n]
    assert above == counted == [SPIKE]
    (alert,) = [a for a in client.get(f"/api/v1/runs/{run_id}/alerts").json()["alerts"]
                if a["rule"] == "activation_norm_spike"]  # fmt: skip
    assert alert["started_step"] == SPIKE

    lines = raw["rule_lines"]
    assert lines["activation"] == {"enabled": True, "field": "act_norm_mean", "min_ratio": 5.0,
                                   "z_threshold": 100.0, "baseline_steps": 128,
                                   "min_baseline_steps": 50}  # fmt: skip
    assert lines["loss_scale"] == {"min_scale": 4.0, "scaler_floor": 0.5,
                                   "floor_headroom_octaves": 4, "floor_headroom_scale": 8.0}  # fmt: skip
    engine = make_engine(collector.database_url)
    with make_sessionmaker(engine)() as session:  # the advisor's healthy scale is the same
        assert run_config(session, run_id).healthy_loss_scale == 4.0
    engine.dispose()

    # Downsampled: a bucket's maximum is above its line exactly where a step was above.
    down = client.get(f"/api/v1/runs/{run_id}/steps", params={"max_points": 20}).json()
    assert down["bucket_width"] > 1
    width, buckets = down["bucket_width"], {}
    for i, step in enumerate(down["step"]):  # a bucket's last point holds its maxima
        line = down["act_threshold"][i]
        assert buckets.get(step // width, (None, line))[1] == line  # one line per bucket
        buckets[step // width] = (decode_float(down["act_norm_mean"][i]), line)
    for key, (top, line) in buckets.items():
        drawn_above = line is not None and top > decode_float(line)
        assert drawn_above == any(key * width <= s < (key + 1) * width for s in counted), key
