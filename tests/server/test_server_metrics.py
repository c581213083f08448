"""`/metrics` moves by exactly what was ingested; `/healthz` and `/readyz` probes."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from wire_batches import layer_record, make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server import migrate
from ampwatch.server.main import create_app
from ampwatch.server.settings import Settings

SAMPLE = re.compile(r"^([a-z_]+)(?:\{(.*)\})? (\S+)$")


def scrape(client: httpx.Client) -> dict[str, float]:
    """`name{labels}` -> value, checking the exposition format on the way."""
    answer = client.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples: dict[str, float] = {}
    for line in answer.text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) ampwatch_[a-z_]+ ", line), line
            continue
        match = SAMPLE.match(line)
        assert match, line
        name, labels, value = match.groups()
        samples[f"{name}{{{labels or ''}}}"] = float(value)
    return samples


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    keys = set(before) | set(after)
    changes = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}
    # Per-run series (`ampwatch_run_*`) have their own tests (test_server_metrics_runs.py).
    return {k: v for k, v in changes.items() if v and not k.startswith("ampwatch_run_")}


def post(client: httpx.Client, batch: Any, **kwargs: Any) -> httpx.Response:
    return client.post(INGEST_PATH, content=json.dumps(batch), **kwargs)


def test_ingest_moves_the_metrics_by_exactly_its_contents(client: httpx.Client) -> None:
    before = scrape(client)
    batch = make_batch(
        0,
        steps=[step_record(s, loss=1.0) for s in (1, 2, 3)],
        layer_stats=[
            layer_record(1, ["a", "b"], [0.1, 0.2]),
            layer_record(2, ["a", "b", "c"], [0.1, 0.2, 0.3]),
        ],
    )
    assert post(client, batch).status_code == 200
    first = scrape(client)
    assert delta(before, first) == {
        "ampwatch_ingest_batches_total{}": 1,
        "ampwatch_ingest_steps_total{}": 3,
        "ampwatch_ingest_layer_values_total{}": 5,
        'ampwatch_runs{project="default",status="running"}': 1,
    }
    lag = first['ampwatch_run_lag_seconds{project="default",run="gpt-small",run_id="1"}']
    assert 0 <= lag < 60

    assert post(client, batch).json()["duplicate"] is True
    second = scrape(client)
    assert delta(first, second) == {"ampwatch_ingest_duplicate_batches_total{}": 1}

    batch["seq"] = 1
    batch["steps"] = [{"step": "one"}]
    assert post(client, batch).status_code == 422
    client.post(INGEST_PATH, content=b"x", headers={"content-encoding": "br"})
    third = scrape(client)
    assert delta(second, third) == {
        'ampwatch_ingest_rejected_total{reason="invalid"}': 1,
        'ampwatch_ingest_rejected_total{reason="unsupported_encoding"}': 1,
    }


def test_an_ended_run_has_no_lag(client: httpx.Client) -> None:
    run_id = post(client, make_batch(0)).json()["run_id"]
    assert any(k.startswith("ampwatch_run_lag_seconds") for k in scrape(client))
    client.post(f"/api/v1/runs/{run_id}/end")
    metrics = scrape(client)
    assert not any(k.startswith("ampwatch_run_lag_seconds") for k in metrics)
    assert metrics['ampwatch_runs{project="default",status="ended"}'] == 1


def test_label_values_are_escaped(client: httpx.Client) -> None:
    client.post("/api/v1/runs", json={"client_run_id": "q", "name": 'a "quoted"\\ name'})
    text = client.get("/metrics").text
    assert 'run="a \\"quoted\\"\\\\ name"' in text


def test_probes(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "revision": migrate.head_revision()}


def test_readyz_is_503_below_the_migration_head(client: httpx.Client, collector: Any) -> None:
    migrate.downgrade(collector.database_url, "0001")
    answer = client.get("/readyz")
    assert answer.status_code == 503
    assert "ampwatch db upgrade" in answer.json()["detail"]
    assert client.get("/healthz").status_code == 200  # alive, just not ready
    migrate.upgrade(collector.database_url)
    assert client.get("/readyz").status_code == 200


@pytest.mark.postgres
def test_readyz_and_the_api_are_503_when_the_database_is_unreachable() -> None:
    admin = "admin-token-for-an-unreachable-database"
    settings = Settings(
        database_url="postgresql+psycopg://postgres@127.0.0.1:1/none?connect_timeout=2",
        dashboard=False,
        admin_token=admin,
    )
    transport = httpx.ASGITransport(app=create_app(settings))  # no lifespan: no startup check

    async def probe() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        # A loopback Host: a collector on loopback refuses other names (`origin.py`).
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            api = await http.get("/api/v1/runs", headers={"Authorization": f"Bearer {admin}"})
            return await http.get("/readyz"), await http.get("/healthz"), api

    ready, alive, api = asyncio.run(probe())
    assert ready.status_code == 503
    assert "database unreachable" in ready.json()["detail"]
    assert alive.status_code == 200
    # The probe saw 500s where the database was busy: an API call is a 503 agents retry.
    assert (api.status_code, api.headers.get("Retry-After")) == (503, "1"), api.text
    assert "retry" in api.json()["detail"]


def test_the_counts_of_every_process_in_the_counter_folder_are_summed(tmp_path: Path) -> None:
    """Workers of one collector count in files of their own (`metrics.IngestCounters`);
    any of them reads the sum, a worker that has exited included."""
    from ampwatch.server.metrics import IngestCounters

    count = (
        "import sys; from pathlib import Path; from ampwatch.server.metrics import IngestCounters\n"
        "counters = IngestCounters(Path(sys.argv[1]))\n"
        "for status in map(int, sys.argv[2:]): counters.record_rejection(status)\n"
    )
    for statuses in (["401", "413"], ["401", "429", "500"]):
        subprocess.run([sys.executable, "-c", count, str(tmp_path), *statuses], check=True,
                       timeout=60)  # fmt: skip
    here = IngestCounters(tmp_path)
    here.record_rejection(422)
    totals, rejected = here.totals()
    assert totals == {"batches": 0, "duplicates": 0, "steps": 0, "layer_values": 0}
    assert rejected == {"unauthenticated": 2, "too_large": 1, "429": 1, "invalid": 1}
    assert len(list(tmp_path.iterdir())) == 3
    alone = IngestCounters()
    alone.record_rejection(401)
    assert alone.totals()[1] == {"unauthenticated": 1}
