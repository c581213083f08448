"""Wire batches built the way the agent builds them, with `ampwatch.agent.wire` helpers."""

from __future__ import annotations

from typing import Any, cast

from ampwatch.agent.wire import (
    STEP_FLOAT_FIELDS,
    WIRE_VERSION,
    Batch,
    EventRecord,
    LayerStatsRecord,
    StepRecord,
    encode_float,
    encode_floats,
)


def step_record(step: int, *, rank: int = 0, skipped: bool = False, **floats: Any) -> StepRecord:
    record: dict[str, Any] = {"step": step, "rank": rank, "skipped": skipped}
    for field in STEP_FLOAT_FIELDS:
        record[field] = encode_float(floats.get(field))
    return cast(StepRecord, record)


def layer_record(
    step: int, names: list[str], zero_fraction: list[float], *, rank: int = 0
) -> LayerStatsRecord:
    return {
        "step": step,
        "rank": rank,
        "names": names,
        "stats": {"zero_fraction": encode_floats(zero_fraction)},
    }


def make_batch(
    seq: int = 0,
    *,
    client_run_id: str = "run-a",
    stream: str = "5eed",
    steps: list[StepRecord] | None = None,
    layer_stats: list[LayerStatsRecord] | None = None,
    events: list[EventRecord] | None = None,
) -> Batch:
    return {
        "wire_version": WIRE_VERSION,
        "run": {"client_run_id": client_run_id, "name": "gpt-small", "project": "default"},
        "stream": stream,
        "seq": seq,
        "steps": steps or [],
        "layer_stats": layer_stats or [],
        "events": events or [],
        "dropped": {"steps": 0, "layer_stats": 0, "events": 0},
    }
