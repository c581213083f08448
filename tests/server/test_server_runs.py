"""Runs API: create or resume, list with filters and paging, get, end, delete."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from wire_batches import layer_record, make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server.db import make_engine
from ampwatch.server.models import Base, Run

RUNS = "/api/v1/runs"


def create(
    client: httpx.Client, client_run_id: str, name: str = "gpt", **extra: Any
) -> httpx.Response:
    return client.post(RUNS, json={"client_run_id": client_run_id, "name": name, **extra})


def test_create_is_201_then_resume_is_200_with_the_same_run(client: httpx.Client) -> None:
    first = create(client, "abc", project="nlp")
    assert first.status_code == 201, first.text
    run = first.json()
    assert (run["client_run_id"], run["name"], run["project"], run["status"]) == (
        "abc", "gpt", "nlp", "running"
    )  # fmt: skip
    assert run["steps"] == 0 and run["last_step"] is None

    assert client.post(f"{RUNS}/{run['id']}/end").json()["status"] == "ended"
    again = create(client, "abc", project="nlp")
    assert again.status_code == 200
    assert again.json()["id"] == run["id"]
    assert again.json()["status"] == "running"  # resumed
    assert len(client.get(RUNS).json()["runs"]) == 1


def test_ingest_appends_to_a_run_created_through_the_api(client: httpx.Client) -> None:
    run_id = create(client, "run-a").json()["id"]
    ack = client.post(INGEST_PATH, content=json.dumps(make_batch(0, steps=[step_record(3)])))
    assert ack.json()["run_id"] == run_id
    assert client.get(f"{RUNS}/{run_id}").json()["last_step"] == 3


def test_the_same_client_run_id_in_another_project_is_another_run(client: httpx.Client) -> None:
    nlp = create(client, "abc", project="nlp")
    vision = create(client, "abc", project="vision")
    assert (nlp.status_code, vision.status_code) == (201, 201)
    assert nlp.json()["id"] != vision.json()["id"]
    assert create(client, "abc", project="nlp").json()["id"] == nlp.json()["id"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"name": "gpt"}, "Field required"),
        ({"client_run_id": "", "name": "gpt"}, "at least 1 character"),
        ({"client_run_id": "a", "name": "x" * 600}, "at most 512 characters"),
        ({"client_run_id": "a", "name": "gpt", "colour": "red"}, "Extra inputs"),
        ({"client_run_id": 5, "name": "gpt"}, "valid string"),
        ({"client_run_id": "a\x00b", "name": "gpt"}, "pattern"),
        ([1, 2], "valid dictionary"),
    ],
)
def test_create_rejects_bad_bodies(
    client: httpx.Client, count_rows: Callable[[], dict[str, int]], body: Any, message: str
) -> None:
    before = count_rows()
    answer = client.post(RUNS, json=body)
    assert answer.status_code == 422
    assert message in json.dumps(answer.json())
    assert count_rows() == before


def test_create_rejects_malformed_json(client: httpx.Client) -> None:
    answer = client.post(RUNS, content=b"{not json", headers={"content-type": "application/json"})
    assert answer.status_code == 422


def test_list_filters_by_project_status_and_name(client: httpx.Client) -> None:
    ids = {
        key: create(client, key, name=name, project=project).json()["id"]
        for key, name, project in [
            ("a", "GPT-small 100%", "nlp"),
            ("b", "gpt_large", "nlp"),
            ("c", "resnet", "vision"),
            ("d", "gptXlarge", "vision"),
        ]
    }
    client.post(f"{RUNS}/{ids['b']}/end")

    def names(**params: Any) -> list[str]:
        answer = client.get(RUNS, params=params)
        assert answer.status_code == 200, answer.text
        return [run["client_run_id"] for run in answer.json()["runs"]]

    assert names() == ["d", "c", "b", "a"]  # newest first
    assert names(project="nlp") == ["b", "a"]
    assert names(status="ended") == ["b"]
    assert names(status="running", project="vision") == ["d", "c"]
    assert names(q="gpt") == ["d", "b", "a"]  # case-insensitive substring
    assert names(q="_") == ["b"]  # LIKE wildcards are literal
    assert names(q="%") == ["a"]
    assert names(project="nosuch") == []


def test_list_carries_health_and_recent_skip_rate(client: httpx.Client, collector: Any) -> None:
    """`skip_rate` covers the last SKIP_RATE_BUCKETS rollups (1,024 steps), from rollups."""
    steps = [step_record(s, skipped=s > 2000 and s % 4 == 0, loss=1.0, loss_scale=2.0**15)
             for s in range(1, 3072)]  # fmt: skip
    for seq, first in enumerate(range(0, len(steps), 1000)):
        body = make_batch(seq, steps=steps[first : first + 1000])
        ack = client.post(INGEST_PATH, content=json.dumps(body))
        assert ack.status_code == 200, ack.text
    quiet = create(client, "quiet").json()
    assert quiet["health"] == "ok" and quiet["skip_rate"] is None
    engine = make_engine(collector.database_url)
    with engine.begin() as connection:  # the alert engine's column, set here by hand
        connection.execute(
            Run.__table__.update().where(Run.id == quiet["id"]).values(health="critical")
        )
    engine.dispose()

    runs = {run["client_run_id"]: run for run in client.get(RUNS).json()["runs"]}
    # Steps 2048..3071 are the last 16 rollups of 64; every 4th of them is skipped.
    assert runs["run-a"]["skip_rate"] == pytest.approx(0.25)
    assert client.get(f"{RUNS}/{runs['run-a']['id']}").json()["skip_rate"] == pytest.approx(0.25)
    for health in ("ok", "warning", "critical"):
        matching = client.get(RUNS, params={"health": health}).json()["runs"]
        assert {r["client_run_id"] for r in matching} == {
            key for key, run in runs.items() if run["health"] == health
        }
    assert runs["quiet"]["health"] == "critical"
    assert client.get(RUNS, params={"health": "fine"}).status_code == 422


def test_step_count_is_exact_where_steps_were_dropped(client: httpx.Client) -> None:
    """Steps 5 and 6 never arrived (the agent dropped them): they are not counted."""
    steps = [step_record(s, skipped=s == 3, loss=1.0) for s in range(1, 11) if s not in (5, 6)]
    ack = client.post(INGEST_PATH, content=json.dumps(make_batch(0, steps=steps)))
    assert ack.status_code == 200, ack.text
    (run,) = client.get(RUNS).json()["runs"]
    assert (run["steps"], run["last_step"], run["skipped_steps"]) == (8, 10, 1)
    assert run["skip_rate"] == pytest.approx(1 / 8)


def test_list_pages_with_limit_offset_and_total(client: httpx.Client) -> None:
    for i in range(5):
        create(client, f"run-{i}")
    page = client.get(RUNS, params={"limit": 2, "offset": 1}).json()
    assert [run["client_run_id"] for run in page["runs"]] == ["run-3", "run-2"]
    assert (page["total"], page["limit"], page["offset"]) == (5, 2, 1)
    last = client.get(RUNS, params={"limit": 2, "offset": 4}).json()
    assert [run["client_run_id"] for run in last["runs"]] == ["run-0"]
    assert client.get(RUNS, params={"offset": 10}).json()["runs"] == []


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 1001},
        {"offset": -1},
        {"limit": "ten"},
        {"status": "crashed"},
        {"q": "x" * 513},
    ],
)
def test_list_rejects_bad_parameters(client: httpx.Client, params: dict[str, Any]) -> None:
    answer = client.get(RUNS, params=params)
    assert answer.status_code == 422, answer.text


@pytest.mark.parametrize("run_id", ["999", "0", "-1", str(2**40)])
def test_unknown_run_is_404_on_every_run_route(client: httpx.Client, run_id: str) -> None:
    for method, path in [("GET", ""), ("POST", "/end"), ("DELETE", "")]:
        answer = client.request(method, f"{RUNS}/{run_id}{path}")
        assert answer.status_code == 404, (method, path, answer.text)
        assert run_id in answer.json()["detail"]


def test_non_integer_run_id_is_422(client: httpx.Client) -> None:
    assert client.get(f"{RUNS}/abc").status_code == 422
    assert client.get(f"{RUNS}/\u0661").status_code == 422  # a digit Python reads, not pydantic


def test_a_run_id_however_pydantic_spells_it_reads_that_run(client: httpx.Client) -> None:
    """The caller's hop reads the run for plain digits only (`deps.resolve_caller`); the
    other spellings FastAPI accepts read it in `existing_run_id`, with the same answer."""
    run_id = create(client, "spelled").json()["id"]
    for spelled in (f"+{run_id}", f"{run_id}.0", f"0{run_id}"):
        answer = client.get(f"{RUNS}/{spelled}")
        assert answer.status_code == 200, (spelled, answer.text)
        assert answer.json()["id"] == run_id


def test_end_marks_the_run_ended_once(client: httpx.Client) -> None:
    run_id = create(client, "abc").json()["id"]
    ended = client.post(f"{RUNS}/{run_id}/end", json={"reason": "diverged"})
    assert ended.status_code == 200
    assert ended.json()["status"] == "ended"
    again = client.post(f"{RUNS}/{run_id}/end", json={"reason": "other"})
    assert again.status_code == 200 and again.json()["status"] == "ended"
    assert client.get(RUNS, params={"status": "ended"}).json()["total"] == 1


@pytest.mark.parametrize("body", [{"reason": 5}, {"reason": ""}, {"why": "x"}, [1]])
def test_end_rejects_bad_bodies(client: httpx.Client, body: Any) -> None:
    run_id = create(client, "abc").json()["id"]
    assert client.post(f"{RUNS}/{run_id}/end", json=body).status_code == 422
    assert client.get(f"{RUNS}/{run_id}").json()["status"] == "running"


def _rows_of_run(database_url: str, run_id: int) -> dict[str, int]:
    """Rows referring to `run_id` in every table that has a run_id column, and runs itself."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            counts = {}
            for name, table in Base.metadata.tables.items():
                column = table.c.get("run_id", table.c.id if name == "runs" else None)
                if column is not None:
                    query = select(func.count()).select_from(table).where(column == run_id)
                    counts[name] = connection.scalar(query) or 0
            return counts
    finally:
        engine.dispose()


def test_delete_removes_every_row_of_the_run_and_nothing_else(
    client: httpx.Client, collector: Any
) -> None:
    def ingest(client_run_id: str) -> int:
        batch = make_batch(
            0,
            client_run_id=client_run_id,
            steps=[step_record(1, loss=1.0), step_record(2, loss=0.5)],
            layer_stats=[layer_record(1, ["a", "b"], [0.1, 0.2])],
            events=[{"kind": "run_start", "step": None, "time": 1.0, "data": {}}],
        )
        return int(client.post(INGEST_PATH, content=json.dumps(batch)).json()["run_id"])

    doomed, kept = ingest("doomed"), ingest("kept")
    assert all(_rows_of_run(collector.database_url, doomed)[t] > 0
               for t in ("runs", "steps", "layers", "layer_stats", "events", "ingested_batches"))  # fmt: skip
    kept_rows = _rows_of_run(collector.database_url, kept)

    answer = client.delete(f"{RUNS}/{doomed}")
    assert answer.status_code == 204 and answer.content == b""
    assert set(_rows_of_run(collector.database_url, doomed).values()) == {0}
    assert _rows_of_run(collector.database_url, kept) == kept_rows
    assert client.get(f"{RUNS}/{doomed}").status_code == 404
    assert client.delete(f"{RUNS}/{doomed}").status_code == 404
    assert [run["id"] for run in client.get(RUNS).json()["runs"]] == [kept]
