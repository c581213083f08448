"""Hostile input answered with a clear 4xx, never a 5xx: NaN/Infinity/1e999 literals in the
JSON body of every write route, deep nesting, the largest step numbers, NUL bytes.

Each case is what a probe of the collector found answering 500 before.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from wire_batches import make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server.ingest_worker import NON_FINITE_HINT
from ampwatch.server.schemas.wire import (
    MAX_BATCH_LAYER_NAMES,
    MAX_BATCH_LAYER_VALUES,
    MAX_BATCH_RECORDS,
    MAX_BIGINT,
    MAX_DATA_DEPTH,
    MAX_STEP,
)

NON_FINITE_LITERALS = ["NaN", "Infinity", "-Infinity", "1e999"]


def _write_routes(run_id: int) -> list[tuple[str, str, str]]:
    """(method, path, body template) of every route that takes a JSON body; `{x}` is
    where the literal goes."""
    return [
        ("POST", "/api/v1/runs", '{"client_run_id": "r", "name": "n", "project": {x}}'),
        ("POST", "/api/v1/runs", '{"client_run_id": {x}, "name": "n"}'),
        ("POST", f"/api/v1/runs/{run_id}/end", '{"reason": {x}}'),
        ("PUT", f"/api/v1/runs/{run_id}/alert-config",
         '{"rules": {"skip_rate": {"max_rate": {x}}}}'),
        ("PUT", "/api/v1/projects/default/alert-config",
         '{"rules": {"skip_rate": {"max_rate": {x}}}}'),
        ("POST", "/api/v1/webhooks", '{"url": "https://h.example/", "min_severity": {x}}'),
        ("POST", INGEST_PATH, json.dumps(make_batch(0, client_run_id="nf")).replace(
            '"seq": 0', '"seq": {x}')),
    ]  # fmt: skip


@pytest.fixture
def run_id(client: httpx.Client) -> int:
    answer = client.post(INGEST_PATH, json=make_batch(0, steps=[step_record(1, loss=1.0)]))
    assert answer.status_code == 200, answer.text
    return int(answer.json()["run_id"])


def _assert_clear_4xx(answer: httpx.Response, *codes: int) -> None:
    assert answer.status_code in codes, (answer.status_code, answer.text[:300])
    detail = answer.json()["detail"]  # strict JSON: the body renders
    assert detail


def test_non_finite_literals_in_every_write_route_are_422(
    client: httpx.Client, run_id: int
) -> None:
    for method, path, template in _write_routes(run_id):
        for literal in NON_FINITE_LITERALS:
            body = template.replace("{x}", literal)
            answer = client.request(
                method, path, content=body, headers={"Content-Type": "application/json"}
            )
            _assert_clear_4xx(answer, 422)
            said = answer.text.replace(json.dumps(NON_FINITE_HINT)[1:-1], "")  # the fixed hint
            assert literal not in said or literal == "NaN", answer.text


def test_deeply_nested_bodies_are_422(client: httpx.Client, run_id: int) -> None:
    for depth in (MAX_DATA_DEPTH + 1, 300, 500, 5000):
        data: Any = 1
        for _ in range(depth):
            data = {"d": data}
        event = {"kind": "checkpoint", "step": 1, "time": 1.0, "data": data}
        body = json.dumps(make_batch(1, events=[event])) if depth < 900 else (
            '{"wire_version": 1, "x": ' + "[" * depth + "]" * depth + "}")  # fmt: skip
        _assert_clear_4xx(client.post(INGEST_PATH, content=body), 422)
        value = '{"a": ' * depth + "1" + "}" * depth
        nested = '{"rules": ' + value + "}"
        for path in (
            f"/api/v1/runs/{run_id}/alert-config",
            "/api/v1/projects/default/alert-config",
        ):
            _assert_clear_4xx(
                client.put(path, content=nested, headers={"Content-Type": "application/json"}), 422
            )
        for method, path, template in _write_routes(run_id):  # every field of every route
            body = template.replace("{x}", value)
            answer = client.request(
                method, path, content=body, headers={"Content-Type": "application/json"}
            )
            _assert_clear_4xx(answer, 422)
    # Nothing stored broke the reads that render events and alerts.
    for path in (f"/api/v1/runs/{run_id}/events", "/api/v1/alerts", f"/api/v1/runs/{run_id}"):
        assert client.get(path).status_code == 200


def test_the_largest_step_numbers_are_stored_or_refused_never_500(
    client: httpx.Client,
) -> None:
    for step in (MAX_BIGINT, MAX_BIGINT - 63, MAX_STEP, MAX_STEP - 1):
        batch = make_batch(0, client_run_id=f"big-{step}", steps=[step_record(step, loss=1.0)])
        batch["layer_stats"] = [{"step": step, "names": ["w"], "stats": {"zero_fraction": [0.5]}}]
        batch["events"] = [{"kind": "checkpoint", "step": step, "time": 1.0}]
        answer = client.post(INGEST_PATH, json=batch)
        assert answer.status_code == (200 if step <= MAX_STEP else 422), answer.text
        if answer.status_code == 200:
            run = answer.json()["run_id"]
            for path in (
                "",
                "/steps",
                "/layers",
                "/layers/w/series",
                "/checkpoints",
                f"/steps?start={step}&end={MAX_BIGINT}",
                "/restart-candidates",
                f"/restart-candidates?margin_steps={MAX_STEP}",
                "/resume-plan",
                f"/resume-plan?margin_steps={MAX_STEP}",
            ):
                read = client.get(f"/api/v1/runs/{run}{path}")
                assert read.status_code in (200, 422), (path, read.text[:300])
    for query in (f"start={MAX_BIGINT}", f"end={MAX_BIGINT}", f"start=0&end={MAX_BIGINT + 1}"):
        assert client.get(f"/api/v1/runs/1/steps?{query}").status_code in (200, 404, 422)


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/runs?q=a%00b",
        "/api/v1/runs?project=%00",
        "/api/v1/alerts?rule=%00",
        "/api/v1/runs/1/layers/w%00x/series",
        "/api/v1/projects/a%00b/alert-config",
    ],
)
def test_nul_bytes_in_paths_and_queries_are_400(client: httpx.Client, path: str) -> None:
    _assert_clear_4xx(client.get(path), 400)


def test_nul_bytes_in_body_names_are_422(client: httpx.Client) -> None:
    answer = client.post("/api/v1/runs", json={"client_run_id": "a\x00b", "name": "n"})
    _assert_clear_4xx(answer, 422)
    batch = make_batch(0, client_run_id="nul")
    batch["layer_stats"] = [{"step": 1, "names": ["w\x00"], "stats": {"zero_fraction": [0.5]}}]
    _assert_clear_4xx(client.post(INGEST_PATH, json=batch), 422)


def test_oversized_batches_are_422_and_store_nothing(
    client: httpx.Client, count_rows: Callable[[], dict[str, int]]
) -> None:
    before = count_rows()
    steps = [step_record(i) for i in range(MAX_BATCH_RECORDS + 1)]
    answer = client.post(INGEST_PATH, json=make_batch(0, client_run_id="big", steps=steps))
    _assert_clear_4xx(answer, 422)
    assert f"at most {MAX_BATCH_RECORDS}" in answer.text
    # The probe: a million new layer names held SQLite's write lock for 39 s.
    wide = make_batch(0, client_run_id="wide")
    names = [f"l{i}" for i in range(10**6)]
    wide["layer_stats"] = [{"step": 1, "names": names, "stats": {"zero_fraction": [0] * 10**6}}]
    started = time.monotonic()
    answer = client.post(INGEST_PATH, json=wide)
    _assert_clear_4xx(answer, 422)
    assert f"at most {MAX_BATCH_LAYER_NAMES}" in answer.text
    assert time.monotonic() - started < 10
    # Many values over few names: records x MAX_BATCH_LAYER_NAMES > MAX_BATCH_LAYER_VALUES.
    names = [f"l{i}" for i in range(MAX_BATCH_LAYER_NAMES)]
    deep = make_batch(0, client_run_id="deep")
    records = MAX_BATCH_LAYER_VALUES // MAX_BATCH_LAYER_NAMES + 2
    deep["layer_stats"] = [{"step": s, "names": names, "stats": {"zero_fraction": [0] * len(names)}}
                           for s in range(records)]  # fmt: skip
    answer = client.post(INGEST_PATH, content=gzip.compress(json.dumps(deep).encode()),
                         headers={"Content-Encoding": "gzip"})  # fmt: skip
    assert answer.status_code in (413, 422), answer.text[:300]
    assert count_rows() == before


def test_the_layer_name_cache_is_bounded_by_names_not_runs() -> None:
    from collections import OrderedDict
    from datetime import datetime, timezone

    from ampwatch.server import layer_ingest

    cache: OrderedDict[tuple[str, int, datetime], dict[str, int]] = OrderedDict()
    moment = datetime.now(timezone.utc)
    per_run = layer_ingest._NAMES_CACHED_PER_ENGINE // 4
    for run in range(10):
        layer_ingest._remember(cache, ("layers", run, moment), {f"n{i}": i for i in range(per_run)})
    assert sum(map(len, cache.values())) <= layer_ingest._NAMES_CACHED_PER_ENGINE
    assert [key[1] for key in cache] == [6, 7, 8, 9]  # the most recent runs stay
    layer_ingest._remember(cache, ("layers", 99, moment), {f"n{i}": i for i in range(10**6)})
    assert not cache  # one run over the bound alone is not kept
