"""Several workers behind one port, scraped as the shipped Prometheus config scrapes them:
the collector's ingest counters equal what was stored, whichever worker answers.

Before (issue 26): each worker counted for itself and labelled its series `pid`;
Prometheus keeps one connection to its one target (`deploy/prometheus/prometheus.yml`),
so it saw one worker: `sum(ampwatch_ingest_steps_total)` read 750 against 1,180 stored.
A real Prometheus (Debian's package; skipped without it) runs the shipped scrape job, with
only its target, token file and interval made local.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from reliability_procs import CollectorProcess, RowCounter, free_port, wait_for
from reliability_support import wire_batch
from sqlalchemy import func, select

from ampwatch.server import auth
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.metrics import COUNTER_FILE_SUFFIX
from ampwatch.server.models import IngestedBatch
from ampwatch.server.step_models import Step

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
ADMIN = "admin-token-for-the-workers-test"
BATCHES = 40


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[str, str], str]]:
    """Start Prometheus with the shipped config, scraping `target` with `token` every
    second; returns its URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian package prometheus)")
    processes: list[subprocess.Popen[bytes]] = []

    def start(target: str, token: str) -> str:
        config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
        (job,) = config["scrape_configs"]
        token_file = tmp_path / "token"
        token_file.write_text(token)
        job["authorization"]["credentials_file"] = str(token_file)
        job["static_configs"] = [{"targets": [target]}]
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(PROMETHEUS / "ampwatch-rules.yml")]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        with (tmp_path / "prometheus.log").open("wb") as log:  # the child keeps its copy
            processes.append(subprocess.Popen(
                [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=log,
            ))  # fmt: skip
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert processes[-1].poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=90, what="prometheus")
        return url

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=30)


def _query(url: str, expr: str) -> float | None:
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


@pytest.mark.postgres
def test_two_workers_count_what_was_stored_as_prometheus_scrapes_them(
    migrated_postgres: str,
    collector_process: Callable[..., CollectorProcess],
    rows: RowCounter,
    prometheus: Callable[[str, str], str],
    tmp_path: Path,
) -> None:
    engine = make_engine(migrated_postgres)
    with make_sessionmaker(engine)() as session:
        scraper = auth.create_token(session, project=None, scope="metrics").token
    engine.dispose()
    counters = tmp_path / "counters"
    collector = collector_process(workers=2, AMPWATCH_ADMIN_TOKEN=ADMIN, AMPWATCH_AUTH="token",
                                  AMPWATCH_METRICS_DIR=str(counters))  # fmt: skip
    assert len(collector.worker_pids()) == 2
    server = prometheus(collector.url.removeprefix("http://"), scraper)

    headers = {"Authorization": f"Bearer {ADMIN}", "Content-Encoding": "gzip"}
    sent_steps = 0
    for seq in range(BATCHES):  # a fresh connection each: the kernel spreads them
        body, steps, _ = wire_batch(f"run-{seq % 4}", seq, steps_per_batch=9,
                                    layers=4, layer_every=3)  # fmt: skip
        answer = httpx.post(f"{collector.url}/api/v1/ingest", content=body, headers=headers,
                            timeout=60)  # fmt: skip
        assert answer.status_code == 200, answer.text
        sent_steps += steps
    duplicate, _, _ = wire_batch("run-0", 0, steps_per_batch=7, layers=4, layer_every=3)
    assert httpx.post(f"{collector.url}/api/v1/ingest", content=duplicate, headers=headers,
                      timeout=60).json()["duplicate"]  # fmt: skip
    refused = httpx.post(f"{collector.url}/api/v1/ingest", content=b"{}", timeout=60)
    assert refused.status_code == 401

    stored_steps = rows.scalar(select(func.count()).select_from(Step))
    stored_batches = rows.scalar(select(func.count()).select_from(IngestedBatch))
    assert (stored_steps, stored_batches) == (sent_steps, BATCHES)
    expected: dict[str, Any] = {
        "sum(ampwatch_ingest_steps_total)": float(stored_steps),
        "sum(ampwatch_ingest_batches_total)": float(stored_batches),
        "sum(ampwatch_ingest_duplicate_batches_total)": 1.0,
        'sum(ampwatch_ingest_rejected_total{reason="unauthenticated"})': 1.0,
    }

    def scraped_all() -> bool:
        return all(_query(server, expr) == value for expr, value in expected.items())

    try:
        wait_for(scraped_all, timeout=60, what="Prometheus to scrape the stored counts")
    finally:
        seen = {expr: _query(server, expr) for expr in expected}
        print(f"2 workers, {BATCHES} batches: stored {stored_steps} steps; "
              f"Prometheus read {seen}")  # fmt: skip
    # Each worker counts in its own file (its first slot: batches it stored).
    files = sorted(counters.glob(f"*{COUNTER_FILE_SUFFIX}"))
    assert {f.name.removesuffix(COUNTER_FILE_SUFFIX) for f in files} == {
        str(pid) for pid in collector.worker_pids()
    }
    split = [int.from_bytes(f.read_bytes()[:8], "little") for f in files]
    assert sum(split) == BATCHES
    print(f"batches stored by each worker: {split}")

    # Every worker answers the same sums (fresh connections reach both).
    scrapes = set()
    for _ in range(8):
        text = httpx.get(f"{collector.url}/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {scraper}"}).text  # fmt: skip
        scrapes.add(next(line for line in text.splitlines()
                         if line.startswith("ampwatch_ingest_steps_total")))  # fmt: skip
    assert scrapes == {f"ampwatch_ingest_steps_total {stored_steps}"}
