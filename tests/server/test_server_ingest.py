"""Ingest through HTTP and read back: values, idempotency, and rejection of bad batches."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from wire_batches import layer_record, make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH, STEP_FLOAT_FIELDS, decode_float
from ampwatch.server import ingest_worker
from ampwatch.server.auth import Principal
from ampwatch.server.db import make_engine
from ampwatch.server.models import Run

Counts = Callable[[], dict[str, int]]
#: The tables ingest writes; auth's tables (projects, tokens) are not ingest's business.
DATA_TABLES = (
    "runs", "ingested_batches", "steps", "step_rollups", "layers", "layer_stats",
    "layer_histograms", "events", "modules",
)  # fmt: skip
EMPTY = dict.fromkeys(DATA_TABLES, 0)


def data_rows(count_rows: Counts) -> dict[str, int]:
    counts = count_rows()
    return {table: counts[table] for table in DATA_TABLES}


def post(client: httpx.Client, batch: Any, **kwargs: Any) -> httpx.Response:
    return client.post(INGEST_PATH, content=json.dumps(batch), **kwargs)


def only_run_id(client: httpx.Client) -> int:
    (run,) = client.get("/api/v1/runs").json()["runs"]
    return int(run["id"])


def test_healthz(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}


def test_steps_round_trip_with_non_finite_distinct_from_null(client: httpx.Client) -> None:
    losses = [2.5, math.nan, math.inf, -math.inf, None]
    steps = [
        step_record(i + 1, loss=loss, loss_scale=65536.0 / 2**i, skipped=i in (1, 2), lr=1e-3)
        for i, loss in enumerate(losses)
    ]
    ack = post(client, make_batch(0, steps=steps))
    assert ack.status_code == 200, ack.text
    run_id = ack.json()["run_id"]
    # The answer carries the run's firing alerts: the NaN loss of step 2 fired nan_loss.
    nan_loss = {"id": 1, "rule": "nan_loss", "layer": "", "severity": "critical", "step": 2}
    assert ack.json() == {
        "run_id": run_id, "stream": "5eed", "seq": 0, "duplicate": False, "alerts": [nan_loss],
    }  # fmt: skip

    series = client.get(f"/api/v1/runs/{run_id}/steps").json()
    assert series["step"] == [1, 2, 3, 4, 5]
    assert series["loss"] == [2.5, "NaN", "Infinity", "-Infinity", None]
    assert series["loss_scale"] == [65536.0, 32768.0, 16384.0, 8192.0, 4096.0]
    assert series["skipped"] == [False, True, True, False, False]
    assert series["grad_norm"] == [None] * 5
    assert series["lr"] == [1e-3] * 5
    assert set(series) == {
        "step", "skipped", *STEP_FLOAT_FIELDS, "skipped_count", "bucket_width", "lr_groups",
        "act_threshold", "act_above_count", "rule_lines",
    }  # fmt: skip
    assert series["grad_norm_clipped"] == [None] * 5
    assert series["act_prenorm_mean"] == series["act_prenorm_max"] == [None] * 5
    assert series["adam_rms_max"] == series["update_ratio_max"] == [None] * 5
    assert series["lr_groups"] == [None] * 5  # one param group: `lr` alone
    assert series["skipped_count"] == [0, 1, 1, 0, 0]
    assert series["bucket_width"] == 1

    run = client.get(f"/api/v1/runs/{run_id}").json()
    assert run["steps"] == 5
    assert run["last_step"] == 5
    assert run["last_loss_scale"] == 4096.0
    assert run["skipped_steps"] == 2
    assert run["status"] == "running"


def test_clipped_grad_norm_round_trips_raw_and_downsampled(client: httpx.Client) -> None:
    """The norm after the loop's clip is stored besides the one before it, NaN kept, and
    a record without the field (an agent that did not clip) reads back as null."""
    steps = [
        step_record(i, grad_norm=10.0 * i, grad_norm_clipped=min(10.0 * i, 25.0))
        for i in range(1, 201)
    ]
    steps[2]["grad_norm"], steps[2]["grad_norm_clipped"] = "Infinity", "NaN"
    del steps[3]["grad_norm_clipped"]
    ack = post(client, make_batch(0, steps=steps))
    assert ack.status_code == 200, ack.text
    path = f"/api/v1/runs/{ack.json()['run_id']}/steps"

    raw = client.get(path).json()
    assert raw["grad_norm"][:4] == [10.0, 20.0, "Infinity", 40.0]
    assert raw["grad_norm_clipped"][:5] == [10.0, 20.0, "NaN", None, 25.0]
    assert raw["grad_norm_clipped"][199] == 25.0

    small = client.get(path, params={"max_points": 20}).json()  # from the rollups
    assert small["bucket_width"] > 1
    assert small["grad_norm_clipped"][0] == 10.0  # the first bucket's minimum
    assert small["grad_norm_clipped"][1] == "NaN"  # its maximum: NaN sorts above
    assert set(small["grad_norm_clipped"][2:]) == {25.0}


def test_run_summary_carries_non_finite_last_loss_scale(client: httpx.Client) -> None:
    post(client, make_batch(0, steps=[step_record(1, loss_scale=math.inf)]))
    assert client.get("/api/v1/runs").json()["runs"][0]["last_loss_scale"] == "Infinity"


def test_ranks_are_separate_series_and_steps_count_once(client: httpx.Client) -> None:
    steps = [step_record(s, rank=r, loss=float(10 * r + s)) for r in (0, 1) for s in (1, 2)]
    run_id = post(client, make_batch(0, steps=steps)).json()["run_id"]
    rank1 = client.get(f"/api/v1/runs/{run_id}/steps", params={"rank": 1}).json()
    assert rank1["loss"] == [11.0, 12.0]
    assert client.get(f"/api/v1/runs/{run_id}").json()["steps"] == 2


def test_layer_matrix_unpacks_by_step_and_layer(client: httpx.Client) -> None:
    first = make_batch(
        0,
        layer_stats=[
            layer_record(10, ["fc1.weight", "fc1.bias"], [0.0, 0.25]),
            layer_record(20, ["fc1.weight", "fc1.bias"], [math.nan, math.inf]),
        ],
    )
    # A layer seen only later extends the matrix; one record omits fc1.bias.
    second = make_batch(1, layer_stats=[layer_record(30, ["head.weight", "fc1.weight"], [1, 0.5])])
    run_id = post(client, first).json()["run_id"]
    assert post(client, second).status_code == 200

    matrix = client.get(f"/api/v1/runs/{run_id}/layers", params={"stat": "zero_fraction"}).json()
    assert matrix == {
        "stat": "zero_fraction",
        "layers": ["fc1.weight", "fc1.bias", "head.weight"],
        "steps": [10, 20, 30],
        "values": [
            [0.0, 0.25, None],  # head.weight did not exist yet: not measured
            ["NaN", "Infinity", None],  # a measured NaN is not "missing"
            [0.5, None, 1.0],
        ],
        "step_width": 1,
        "layer_width": 1,
    }
    assert client.get(f"/api/v1/runs/{run_id}/layers", params={"rank": 1}).json()["steps"] == []


def test_records_of_one_step_in_one_batch_merge(client: httpx.Client) -> None:
    batch = make_batch(
        0,
        layer_stats=[
            layer_record(5, ["a", "b"], [0.1, 0.2]),
            layer_record(5, ["b", "c"], [0.3, 0.4]),
        ],
    )
    run_id = post(client, batch).json()["run_id"]
    matrix = client.get(f"/api/v1/runs/{run_id}/layers").json()
    assert matrix["steps"] == [5]
    assert matrix["values"] == [[0.1, 0.3, 0.4]]


def test_events_round_trip_and_run_end_ends_the_run(client: httpx.Client) -> None:
    events: list[Any] = [
        {"kind": "run_start", "step": None, "time": 1_732_870_000.25,
         "data": {"world_size": 2, "dtypes": ["float16"]}},
        {"kind": "checkpoint", "step": 100, "time": 1_732_870_100.5,
         "data": {"path": "/ckpt/100.pt"}},
        {"kind": "run_end", "step": 120, "time": 1_732_870_200.75,
         "data": {"reason": "finished"}},
    ]  # fmt: skip
    run_id = post(client, make_batch(0, events=events)).json()["run_id"]
    assert client.get(f"/api/v1/runs/{run_id}/events").json() == {"events": events}
    run = client.get(f"/api/v1/runs/{run_id}").json()
    assert run["status"] == "ended"


def test_runs_are_listed_newest_first(client: httpx.Client) -> None:
    for seq, name in enumerate(["first", "second", "third"]):
        assert post(client, make_batch(seq, client_run_id=name)).status_code == 200
    runs = client.get("/api/v1/runs").json()["runs"]
    assert [r["client_run_id"] for r in runs] == ["third", "second", "first"]
    assert runs[0]["steps"] == 0 and runs[0]["last_step"] is None
    assert runs[0]["created_at"].endswith(("Z", "+00:00"))


def test_duplicate_batch_is_acknowledged_and_changes_nothing(
    client: httpx.Client, count_rows: Counts
) -> None:
    batch = make_batch(
        0,
        steps=[step_record(1, loss=1.0)],
        layer_stats=[layer_record(1, ["w"], [0.5])],
        events=[{"kind": "run_start", "step": None, "time": 1.0, "data": {}}],
    )
    first = post(client, batch).json()
    counts = count_rows()
    before = client.get(f"/api/v1/runs/{first['run_id']}").json()

    batch["steps"] = [step_record(1, loss=99.0)]  # a retry must not apply anything
    again = post(client, batch)
    assert again.status_code == 200
    assert again.json() == {
        "run_id": first["run_id"],
        "stream": "5eed",
        "seq": 0,
        "duplicate": True,
        "alerts": [],
    }
    assert count_rows() == counts
    assert data_rows(count_rows) == {
        "runs": 1, "ingested_batches": 1, "steps": 1, "step_rollups": 1, "layers": 1,
        "layer_stats": 1, "layer_histograms": 0, "events": 1, "modules": 0,
    }  # fmt: skip
    assert client.get(f"/api/v1/runs/{first['run_id']}").json() == before
    assert client.get(f"/api/v1/runs/{first['run_id']}/steps").json()["loss"] == [1.0]


def test_same_seq_of_another_stream_is_stored_not_a_duplicate(
    client: httpx.Client, count_rows: Counts
) -> None:
    """Two ranks (or a resumed run) share the run id and each number seq from 0."""
    rank0 = make_batch(0, stream="aa", steps=[step_record(1, loss=1.0)])
    rank1 = make_batch(0, stream="bb", layer_stats=[layer_record(1, ["w"], [0.5], rank=1)])
    assert post(client, rank0).json()["duplicate"] is False
    assert post(client, rank1).json()["duplicate"] is False
    assert post(client, rank1).json()["duplicate"] is True  # a retry of that stream still is
    assert data_rows(count_rows)["ingested_batches"] == 2
    assert data_rows(count_rows)["layer_stats"] == 1


@pytest.mark.parametrize("stream", ["", "ABC", "x" * 3, "a" * 65, 7])
def test_batch_without_a_valid_stream_is_rejected(client: httpx.Client, stream: object) -> None:
    batch: dict[str, object] = dict(make_batch(0))
    batch["stream"] = stream
    answer = post(client, batch)
    assert answer.status_code == 422, answer.text
    assert "stream" in answer.text
    del batch["stream"]
    assert post(client, batch).status_code == 422


def test_lr_groups_round_trip_with_non_finite_values(client: httpx.Client) -> None:
    steps = [step_record(1, lr=1e-3), step_record(2, lr=1e-3), step_record(3, lr=2e-3)]
    steps[0]["lr_groups"] = [1e-3, 0.0, 5e-5]
    steps[1]["lr_groups"] = [1e-3, "NaN", "Infinity"]
    ack = post(client, make_batch(0, steps=steps))
    assert ack.status_code == 200, ack.text
    series = client.get(f"/api/v1/runs/{ack.json()['run_id']}/steps").json()
    assert series["lr_groups"] == [[1e-3, 0.0, 5e-5], [1e-3, "NaN", "Infinity"], None]


@pytest.mark.parametrize("lr_groups", [[], ["fast"], [True], 0.1, [0.1] * 1025])
def test_malformed_lr_groups_are_rejected(
    client: httpx.Client, count_rows: Counts, lr_groups: object
) -> None:
    record: dict[str, Any] = dict(step_record(1))
    record["lr_groups"] = lr_groups
    answer = post(client, make_batch(0, steps=[record]))
    assert answer.status_code == 422, answer.text
    assert "lr_groups" in answer.text
    assert data_rows(count_rows) == EMPTY


def test_activations_must_align_with_their_names(client: httpx.Client) -> None:
    record: dict[str, Any] = dict(layer_record(1, ["w"], [0.5]))
    record["activations"] = {"names": ["fc1", "fc2"], "max_abs": [1.0]}
    answer = post(client, make_batch(0, layer_stats=[record]))
    assert answer.status_code == 422 and "activations" in answer.text
    record["activations"] = {"names": ["fc1", "fc1"], "max_abs": [1.0, 2.0]}
    answer = post(client, make_batch(0, layer_stats=[record]))
    assert answer.status_code == 422


def test_resent_step_in_a_new_batch_overwrites(client: httpx.Client, count_rows: Counts) -> None:
    post(client, make_batch(0, steps=[step_record(1, loss=1.0), step_record(2, loss=2.0)]))
    post(client, make_batch(1, steps=[step_record(2, loss=math.nan, skipped=True)]))
    run_id = only_run_id(client)
    series = client.get(f"/api/v1/runs/{run_id}/steps").json()
    assert series["loss"] == [1.0, "NaN"]
    assert series["skipped"] == [False, True]
    assert count_rows()["steps"] == 2


def test_gzip_body(client: httpx.Client) -> None:
    body = gzip.compress(json.dumps(make_batch(0, steps=[step_record(7, loss=0.5)])).encode())
    response = client.post(
        INGEST_PATH,
        content=body,
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert response.status_code == 200, response.text
    run_id = response.json()["run_id"]
    assert client.get(f"/api/v1/runs/{run_id}/steps").json()["step"] == [7]


def test_bare_non_finite_literals_are_refused_and_the_wire_spelling_is_kept(
    client: httpx.Client, count_rows: Counts
) -> None:
    """Strict JSON, as the README says and every other route does: the wire spells the
    non-finite floats "NaN", "Infinity", "-Infinity" and the agent always writes them so;
    a bare literal (and 1e999, past a double: it was stored as +Inf) is a 422 that says
    how to spell it, wherever it stands, and stores nothing."""
    batch = make_batch(0, steps=[step_record(1, loss=1.5)], layer_stats=[
        layer_record(1, ["fc1.weight"], [0.25])],
        events=[{"kind": "finding", "step": 1, "time": 5.0, "data": {"value": 7.5}}])  # fmt: skip
    text = json.dumps(batch)
    for literal in ("NaN", "Infinity", "-Infinity", "1e999", "-1e999"):
        for slot in ('"loss": 1.5', "[0.25]", '"value": 7.5'):
            body = text.replace(slot, slot.replace(slot.split()[-1].strip("[]"), literal))
            assert body != text
            response = client.post(INGEST_PATH, content=body)
            assert response.status_code == 422, (literal, slot, response.text)
            assert '"NaN", "Infinity", "-Infinity"' in response.json()["detail"]
    assert data_rows(count_rows) == EMPTY
    batch["steps"][0]["loss"] = "NaN"
    batch["layer_stats"][0]["stats"]["zero_fraction"] = ["Infinity"]
    batch["events"][0]["data"]["value"] = "-Infinity"
    response = post(client, batch)
    assert response.status_code == 200, response.text
    run_id = response.json()["run_id"]
    assert client.get(f"/api/v1/runs/{run_id}/steps").json()["loss"] == ["NaN"]
    (event,) = client.get(f"/api/v1/runs/{run_id}/events").json()["events"]
    assert decode_float(event["data"]["value"]) == -math.inf


def test_nul_in_free_text_is_stored_alike_and_in_names_refused(
    collector: Any, client: httpx.Client, count_rows: Counts
) -> None:
    """A NUL in a run's end reason, a checkpoint's path or a finding's message (free text
    the agent passes on) is stored on both backends, as U+FFFD where it lands in a text
    column and as JSON's escape in event data; PostgreSQL answered 500 to the reason, and
    the agent retried the batch forever. In a name (run, project, layer) it is a 422."""
    events = [
        {"kind": "checkpoint", "step": 1, "time": 5.0, "data": {"path": "ckpt\x00/1.pt"}},
        {"kind": "finding", "step": 1, "time": 5.0,
         "data": {"code": "clip_before_unscale", "message": "clip\x00 first"}},
        {"kind": "run_end", "step": 2, "time": 6.0, "data": {"reason": "disk\x00full"}},
    ]  # fmt: skip
    response = post(client, make_batch(0, steps=[step_record(1, loss=1.0)], events=events))
    assert response.status_code == 200, response.text
    run_id = response.json()["run_id"]
    engine = make_engine(collector.database_url)
    with engine.connect() as connection:
        reason = connection.scalar(select(Run.end_reason).where(Run.id == run_id))
    engine.dispose()
    assert reason == "disk\ufffdfull"
    stored = client.get(f"/api/v1/runs/{run_id}/events").json()["events"]
    assert [e["data"] for e in stored] == [e["data"] for e in events]
    (alert,) = client.get(f"/api/v1/runs/{run_id}/alerts").json()["alerts"]
    assert alert["rule"] == "clip_before_unscale" and "clip\ufffd first" in alert["message"]
    before = data_rows(count_rows)
    for bad in (make_batch(1, client_run_id="a\x00b"),
                make_batch(1, layer_stats=[layer_record(3, ["fc\x00.weight"], [0.5])])):  # fmt: skip
        response = post(client, bad)
        assert response.status_code == 422, response.text
    assert data_rows(count_rows) == before


def _bad(batch: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    target: Any = batch
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return batch


def _full_batch(seq: int = 0) -> dict[str, Any]:
    return dict(
        make_batch(
            seq,
            steps=[step_record(1, loss=1.0), step_record(2, loss=math.nan)],
            layer_stats=[layer_record(1, ["a", "b"], [0.0, 1.0])],
            events=[{"kind": "run_start", "step": None, "time": 1.0, "data": {}}],
        )
    )


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["steps", 1, "loss"], "1.5", "valid number"),
        (["steps", 1, "loss"], "nan", "'NaN', 'Infinity' or '-Infinity'"),
        (["steps", 0, "step"], "one", "valid integer"),
        (["steps", 0, "step"], -1, "greater than or equal to 0"),
        (["steps", 0, "skipped"], 1, "valid boolean"),
        (["layer_stats", 0, "stats", "zero_fraction"], [0.0], "1 values for 2 names"),
        (["layer_stats", 0, "stats"], {"zero_share": [0.0, 1.0]}, "unknown statistic"),
        (["layer_stats", 0, "names"], ["a", "a"], "unique"),
        (["events", 0, "kind"], "reboot", "unknown event kind"),
        (["run", "name"], "bad\x00name", "pattern"),
        (["run", "client_run_id"], "", "at least 1 character"),
        (["wire_version"], 2, "wire_version 2 is not supported"),
        (["steps", 0, "loss_scal"], 1.0, "Extra inputs are not permitted"),
    ],
)
def test_invalid_batch_is_422_with_message_and_stores_nothing(
    client: httpx.Client, count_rows: Counts, path: list[Any], value: Any, message: str
) -> None:
    response = post(client, _bad(_full_batch(), path, value))
    assert response.status_code == 422
    assert message in response.text
    assert data_rows(count_rows) == EMPTY


def test_invalid_batch_for_a_known_run_changes_nothing(
    client: httpx.Client, count_rows: Counts
) -> None:
    assert post(client, _full_batch(0)).status_code == 200
    counts = count_rows()
    response = post(client, _bad(_full_batch(1), ["steps", 1, "rank"], "zero"))
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["steps", 1, "rank"]
    assert count_rows() == counts


@pytest.mark.parametrize(
    ("body", "headers", "status", "message"),
    [
        (b'{"wire_version": 1, "run": ', {}, 422, "Invalid JSON"),
        (b"[1, 2]", {}, 422, "Input should be an object"),
        (b"\xff\xfe", {}, 422, "Invalid JSON"),
        (b"not gzip", {"Content-Encoding": "gzip"}, 400, "not"),
        (gzip.compress(b'{"a": 1}', mtime=0)[:-12], {"Content-Encoding": "gzip"}, 400, "truncated"),
        (b"{}", {"Content-Encoding": "br"}, 415, "use gzip"),
    ],
)
def test_malformed_body_is_4xx_with_message(
    client: httpx.Client,
    count_rows: Counts,
    body: bytes,
    headers: dict[str, str],
    status: int,
    message: str,
) -> None:
    response = client.post(INGEST_PATH, content=body, headers=headers)
    assert response.status_code == status
    assert message in response.text
    assert data_rows(count_rows) == EMPTY


def _handled(sessions: sessionmaker[Session], batch: Any) -> ingest_worker.Outcome:
    """`batch` through what the ingest process runs (`ingest_worker.handle`), here, where a
    test can make it fail."""
    call = ingest_worker.Call(Principal(project=None), json.dumps(batch).encode(), "")
    return ingest_worker.handle(call, sessions, limit=1 << 25)


def test_a_failure_while_storing_rolls_the_whole_batch_back(
    collector: Any,
    sessions: sessionmaker[Session],
    count_rows: Counts,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from ampwatch.server import ingest

    def fail(*_args: object) -> None:  # after steps and layer stats were written
        raise RuntimeError("disk full")

    monkeypatch.setattr(ingest, "_apply_events", fail)
    assert _handled(sessions, _full_batch()) == ingest_worker.Failed("RuntimeError")
    assert "storing an ingest batch failed; it was rolled back" in caplog.text
    assert data_rows(count_rows) == EMPTY
    monkeypatch.undo()
    stored = _handled(sessions, _full_batch())  # the retry is not a duplicate
    assert isinstance(stored, ingest_worker.Stored) and not stored.duplicate
    assert (stored.steps, stored.layer_values) == (2, 2)
    with httpx.Client(base_url=collector.url) as client:  # the collector reads it
        assert [run["steps"] for run in client.get("/api/v1/runs").json()["runs"]] == [2]


@pytest.mark.parametrize("path", ["", "/steps", "/layers", "/events"])
@pytest.mark.parametrize("run_id", [42, 2**40])
def test_unknown_run_is_404(client: httpx.Client, path: str, run_id: int) -> None:
    response = client.get(f"/api/v1/runs/{run_id}{path}")
    assert response.status_code == 404
    assert response.json() == {"detail": f"run {run_id} not found"}


def test_unknown_layer_stat_is_422(client: httpx.Client) -> None:
    run_id = post(client, _full_batch()).json()["run_id"]
    response = client.get(f"/api/v1/runs/{run_id}/layers", params={"stat": "nope"})
    assert response.status_code == 422
    assert "unknown statistic 'nope'" in response.text


def _layer_values(client: httpx.Client, run_id: int, layer: str) -> list[Any]:
    response = client.get(f"/api/v1/runs/{run_id}/layers/{layer}/series")
    assert response.status_code == 200, response.text
    return list(response.json()["value"])


def test_layer_names_of_a_rolled_back_batch_are_numbered_afresh(
    client: httpx.Client, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ingest remembers committed layer numbering between batches; a batch that failed
    after numbering new layers must not leave them remembered."""
    from ampwatch.server import ingest

    first = make_batch(0, layer_stats=[layer_record(1, ["a"], [0.1])])
    run_id = json.loads(_stored(_handled(sessions, first)).ack)["run_id"]
    monkeypatch.setattr(ingest, "_apply_events", lambda *_args: 1 / 0)
    failing = make_batch(1, layer_stats=[layer_record(2, ["a", "b", "c"], [0.2, 0.3, 0.4])])
    assert _handled(sessions, failing) == ingest_worker.Failed("ZeroDivisionError")
    monkeypatch.undo()
    third = make_batch(2, layer_stats=[layer_record(3, ["c", "a"], [0.5, 0.6])])
    assert not _stored(_handled(sessions, third)).duplicate
    assert _layer_values(client, run_id, "c") == [None, 0.5]  # no c at step 1
    assert _layer_values(client, run_id, "a") == [0.1, 0.6]
    layers = client.get(f"/api/v1/runs/{run_id}/layers", params={"stat": "zero_fraction"})
    assert layers.json()["layers"] == ["a", "c"]


def _stored(outcome: ingest_worker.Outcome) -> ingest_worker.Stored:
    assert isinstance(outcome, ingest_worker.Stored), outcome
    return outcome


def test_a_new_run_reusing_a_deleted_runs_id_gets_its_own_layers(client: httpx.Client) -> None:
    """SQLite hands a deleted run's id to the next run: remembered numbering must not leak."""
    old = make_batch(0, layer_stats=[layer_record(1, ["x", "y"], [0.1, 0.2])])
    old_id = post(client, old).json()["run_id"]
    assert client.delete(f"/api/v1/runs/{old_id}").status_code == 204
    new = make_batch(0, client_run_id="run-b", layer_stats=[layer_record(1, ["y"], [0.9])])
    new_id = post(client, new).json()["run_id"]
    assert _layer_values(client, new_id, "y") == [0.9]
    layers = client.get(f"/api/v1/runs/{new_id}/layers", params={"stat": "zero_fraction"})
    assert layers.json()["layers"] == ["y"]
