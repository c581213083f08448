"""Property: any valid wire batch round-trips exactly through ingest and the read API.

Hypothesis builds batches the wire format allows -- NaN, +-Inf and null among the floats,
several ranks, layers that appear part-way, records without some statistics, optional
exponent histograms, events -- posts each over HTTP to a live collector and reads every
part back through the endpoints the dashboard uses, undownsampled (steps stay within
`MAX_STEP`, and the queries ask for more points than there are steps).
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampwatch.agent.wire import (
    EVENT_KINDS,
    INGEST_PATH,
    LAYER_STATS,
    STEP_FLOAT_FIELDS,
    WIRE_VERSION,
    encode_float,
)

MAX_STEP = 10_000
LAYER_NAMES = ("fc1.weight", "fc1.bias", "blocks.0/attn.qkv", "head.weight", "emb")
#: Leaf module paths (activation statistics): a separate list, which may share a name.
MODULE_NAMES = ("fc1", "blocks.0/attn", "emb", "(model)")
_run_ids = itertools.count()

wire_floats = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.integers(-(2**53), 2**53),
).map(lambda v: encode_float(float(v)) if v is not None else None)
finite_or_marker = wire_floats.filter(lambda v: v is not None)
#: Event data integers: JSON parsers (orjson, JavaScript) hold 64 bits; larger ones are
#: read as floats, a documented limit of the wire format's free-form `data`.
int64s = st.integers(-(2**63), 2**63 - 1)


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    ranks = draw(st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True))
    step_keys = draw(st.lists(
        st.tuples(st.sampled_from(ranks), st.integers(0, MAX_STEP)), max_size=30, unique=True
    ))  # fmt: skip
    steps = [
        {"step": step, "rank": rank, "skipped": draw(st.booleans()),
         **{field: draw(wire_floats) for field in STEP_FLOAT_FIELDS}}
        for rank, step in step_keys
    ]  # fmt: skip
    for record in steps:
        if draw(st.booleans()):
            record["lr_groups"] = draw(st.lists(finite_or_marker, min_size=1, max_size=4))
    record_keys = draw(st.lists(
        st.tuples(st.sampled_from(ranks), st.integers(0, MAX_STEP)), max_size=6, unique=True
    ))  # fmt: skip
    layer_stats = []
    for rank, step in record_keys:
        names = draw(st.lists(st.sampled_from(LAYER_NAMES), min_size=1, unique=True))
        stats = draw(st.lists(st.sampled_from(LAYER_STATS), unique=True))
        record: dict[str, Any] = {
            "step": step, "rank": rank, "names": names,
            "stats": {s: [draw(finite_or_marker) for _ in names] for s in stats},
        }  # fmt: skip
        if draw(st.booleans()):
            offsets = [draw(st.integers(0, 255)) for _ in names]
            record["exponent_histograms"] = {
                "offsets": offsets,
                "counts": [draw(st.lists(st.integers(0, 2**62), max_size=256 - o))
                           for o in offsets],
            }  # fmt: skip
        if draw(st.booleans()):
            modules = draw(st.lists(st.sampled_from(MODULE_NAMES), min_size=1, unique=True))
            record["activations"] = {
                "names": modules,
                "max_abs": [draw(finite_or_marker) for _ in modules],
            }
        layer_stats.append(record)
    events = [
        {"kind": kind, "step": draw(st.none() | st.integers(0, MAX_STEP)),
         "time": float(i), "data": draw(st.dictionaries(st.text(max_size=5), int64s))}
        for i, kind in enumerate(draw(st.lists(st.sampled_from(EVENT_KINDS), max_size=3)))
    ]  # fmt: skip
    return {
        "wire_version": WIRE_VERSION,
        "run": {"client_run_id": f"prop-{next(_run_ids)}", "name": "p", "project": "default"},
        "stream": draw(st.text("0123456789abcdef-", min_size=1, max_size=64)),
        "seq": draw(st.integers(0, 2**40)),
        "steps": steps,
        "layer_stats": layer_stats,
        "events": events,
        "dropped": {"steps": draw(st.integers(0, 10)), "layer_stats": 0, "events": 0},
    }


def same(got: list[Any], want: list[Any]) -> bool:
    """Equal, with floats compared exactly (wire strings and None compare as themselves)."""
    return len(got) == len(want) and all(
        (type(g) is type(w) or {type(g), type(w)} <= {int, float})
        and (g == w or (isinstance(g, float) and math.isnan(g) and math.isnan(w)))
        for g, w in zip(got, want)
    )


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=batches())
def test_any_valid_batch_round_trips(client: httpx.Client, batch: dict[str, Any]) -> None:
    ack = client.post(INGEST_PATH, content=json.dumps(batch))
    assert ack.status_code == 200, ack.text
    run = f"/api/v1/runs/{ack.json()['run_id']}"
    ranks = {s["rank"] for s in batch["steps"]} | {r["rank"] for r in batch["layer_stats"]}
    for rank in ranks:
        mine = sorted((s for s in batch["steps"] if s["rank"] == rank), key=lambda s: s["step"])
        got = client.get(f"{run}/steps", params={"rank": rank, "max_points": MAX_STEP + 1}).json()
        assert got["step"] == [s["step"] for s in mine]
        assert got["skipped"] == [s["skipped"] for s in mine]
        for field in STEP_FLOAT_FIELDS:
            assert same(got[field], [s[field] for s in mine]), field
        assert len(got["lr_groups"]) == len(mine)
        for lrs, s in zip(got["lr_groups"], mine):
            assert lrs is None if "lr_groups" not in s else same(lrs, s["lr_groups"])

    order = list(dict.fromkeys(n for r in batch["layer_stats"] for n in r["names"]))
    for rank, stat in itertools.product(ranks, LAYER_STATS):
        records = sorted(
            (r for r in batch["layer_stats"] if r["rank"] == rank and stat in r["stats"]),
            key=lambda r: r["step"],
        )
        params = {"stat": stat, "rank": rank, "max_steps": MAX_STEP + 1}
        matrix = client.get(f"{run}/layers", params=params).json()
        assert matrix["layers"] == order
        assert matrix["steps"] == [r["step"] for r in records]
        for row, record in zip(matrix["values"], records):
            by_name = dict(zip(record["names"], record["stats"][stat]))
            assert same(row, [by_name.get(name) for name in order])

    measured = [r for r in batch["layer_stats"] if "activations" in r]
    modules = list(dict.fromkeys(n for r in measured for n in r["activations"]["names"]))
    for rank in ranks:
        params = {"stat": "activation_max_abs", "rank": rank, "max_steps": MAX_STEP + 1}
        matrix = client.get(f"{run}/layers", params=params).json()
        mine = sorted((r for r in measured if r["rank"] == rank), key=lambda r: r["step"])
        assert matrix["layers"] == modules
        assert matrix["steps"] == [r["step"] for r in mine]
        for row, record in zip(matrix["values"], mine):
            by_name = dict(zip(record["activations"]["names"], record["activations"]["max_abs"]))
            assert same(row, [by_name.get(name) for name in modules])

    for record in batch["layer_stats"]:
        histograms = record.get("exponent_histograms")
        for i, name in enumerate(record["names"] if histograms else []):
            got = client.get(
                f"{run}/layers/{name}/histograms",
                params={"rank": record["rank"], "step": record["step"]},
            ).json()
            assert got["offsets"] == [histograms["offsets"][i]]
            assert got["counts"] == [histograms["counts"][i]]

    events = client.get(f"{run}/events").json()["events"]
    assert events == [{**e, "time": e["time"]} for e in batch["events"]]
    assert client.get(run).json()["dropped"]["steps"] == batch["dropped"]["steps"]
