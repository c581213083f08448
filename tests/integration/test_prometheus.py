"""A real Prometheus scrapes a real collector with a project's metrics token while an
agent trains a small FP16 model on the CPU; the loss scale, the collector's firing alert
and the shipped alerting rule's page are read back through Prometheus's HTTP query API.

Prometheus is Debian's `prometheus` package (`make test` installs it where it runs as
root); without it the test skips and says so. It listens on 127.0.0.1 only, keeps its
data in the test's tmp_path and is stopped at the end.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from torch import nn

from ampwatch.agent import watch
from ampwatch.server import auth
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.serving import bind_socket

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "ampwatch-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "ampwatch.json"
DEADLINE_S = 90.0


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = answer.json()
        assert answer.status_code == 200 and body["status"] == "success", (expr, body)
        return list(body["data"]["result"])

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None


def _binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip("prometheus is not installed (Debian package prometheus; `make test` "
                    "installs it when run as root)")  # fmt: skip
    return found


@pytest.fixture
def prometheus_for(
    tmp_path: Path,
) -> Iterator[Callable[[str, str], Prometheus]]:
    """Start a Prometheus scraping `target` (host:port) every second with bearer `token`,
    evaluating the shipped alerting rules every second."""
    binary = _binary()
    started: list[Prometheus] = []

    def start(target: str, token: str) -> Prometheus:
        token_file = tmp_path / "scrape-token"
        token_file.write_text(token)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{
                "job_name": "ampwatch",
                "authorization": {"type": "Bearer", "credentials_file": str(token_file)},
                "static_configs": [{"targets": [target]}],
            }],
        }  # fmt: skip
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        sock = bind_socket()  # a free loopback port; Prometheus binds it itself
        port = sock.getsockname()[1]
        sock.close()
        log = tmp_path / "prometheus.log"
        with log.open("wb") as stderr:  # the child keeps its own copy of the descriptor
            process = subprocess.Popen(
                [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip
        server = Prometheus(url=f"http://127.0.0.1:{port}", process=process, log=log)
        started.append(server)
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(f"{server.url}/-/ready", timeout=1).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # polling for readiness, bounded by the deadline
        raise AssertionError(f"prometheus did not become ready:\n{log.read_text()}")

    yield start
    for server in started:
        server.process.terminate()
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=30)


class Trainer:
    """A small model in FP16 autocast on the CPU with a real GradScaler and the agent."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.ReLU(),
                                   nn.Linear(64, 64))  # fmt: skip
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        # No growth during the test: the scale moves only when an overflow halves it.
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
        self.loss_fn = nn.CrossEntropyLoss()
        self.generator = torch.Generator().manual_seed(1)

    def step(self, *, overflow: bool = False) -> None:
        tokens = torch.randint(0, 64, (8, 16), generator=self.generator)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = self.model(tokens)
        loss = self.loss_fn(logits.float().view(-1, 64), tokens.view(-1))
        if overflow:
            loss = loss * 1e30  # the scaled FP16 gradients overflow: the step is skipped
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


def _train_until(trainer: Trainer, done: Callable[[], bool], what: str) -> None:
    """Keep training (healthy steps) and polling Prometheus until `done`, bounded."""
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for _ in range(5):
            trainer.step()


def test_prometheus_scrapes_the_loss_scale_and_a_firing_alert_while_an_agent_trains(
    sqlite_url: str,
    start_collector: Callable[..., AbstractContextManager[Any]],
    prometheus_for: Callable[[str, str], Prometheus],
) -> None:
    with start_collector(sqlite_url, dashboard=False) as collector:
        engine = make_engine(sqlite_url)
        with make_sessionmaker(engine)() as session:
            writer = auth.create_token(session, project="vision").token
            scraper = auth.create_token(session, project="vision", scope="metrics").token
        engine.dispose()
        # The scrape token may scrape and nothing else.
        refused = httpx.get(f"{collector.url}/api/v1/runs",
                            headers={"Authorization": f"Bearer {scraper}"}, timeout=10)  # fmt: skip
        assert refused.status_code == 403

        prometheus = prometheus_for(collector.url.removeprefix("http://"), scraper)
        trainer = Trainer()
        with watch(trainer.model, trainer.optimizer, trainer.scaler, run="prom-e2e",
                   project="vision", url=collector.url, token=writer,
                   flush_interval=0.2) as handle:  # fmt: skip
            selector = 'run="prom-e2e",project="vision"'

            _train_until(
                trainer,
                lambda: prometheus.value(f"ampwatch_run_loss_scale{{{selector}}}") == 1024.0,
                "the healthy loss scale",
            )
            assert prometheus.value('up{job="ampwatch"}') == 1.0
            assert prometheus.value(f"ampwatch_run_health{{{selector}}}") == 0.0
            assert not prometheus.query("ampwatch_run_alerts_firing")

            for _ in range(12):  # twelve overflows: 1024 / 2**12 = 0.25, below 1.0
                trainer.step(overflow=True)
            collapse = (f'ampwatch_run_alerts_firing{{{selector},rule="loss_scale_collapse",'
                        f'severity="critical"}}')  # fmt: skip
            _train_until(trainer, lambda: prometheus.value(collapse) == 1.0,
                         "the firing loss_scale_collapse alert")  # fmt: skip
            _train_until(
                trainer,
                lambda: prometheus.value(f"ampwatch_run_loss_scale{{{selector}}}") == 0.25,
                "the collapsed loss scale",
            )
            assert prometheus.value(f"ampwatch_run_health{{{selector}}}") == 2.0
            skipped = prometheus.value(f"ampwatch_run_skipped_steps_total{{{selector}}}")
            assert skipped == 12.0
            # The shipped rule pages on it (Prometheus's own ALERTS series).
            page = 'ALERTS{alertname="AmpwatchRunCritical",alertstate="firing",rule="loss_scale_collapse"}'
            _train_until(trainer, lambda: prometheus.value(page) == 1.0, "the shipped rule's page")
            (alert,) = prometheus.query(page)
            assert alert["metric"]["run_id"] == _run_id(collector.url, writer)
            assert alert["metric"]["project"] == "vision"

            # Every Grafana panel's query is valid PromQL and finds data here.
            for expr in _dashboard_queries():
                assert prometheus.query(expr), expr
        assert handle.counters["send_failures"] == 0


def _run_id(url: str, token: str) -> str:
    runs = httpx.get(f"{url}/api/v1/runs", headers={"Authorization": f"Bearer {token}"},
                     timeout=10).json()["runs"]  # fmt: skip
    (run,) = runs
    return str(run["id"])


def _dashboard_queries() -> list[str]:
    """Each panel's query as Grafana sends it with every project and run selected."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        target["expr"].replace("$project", ".*").replace("$run", ".*")
        .replace("$__rate_interval", "1m")
        for panel in dashboard["panels"] for target in panel["targets"]
        # The collector's own counters are for all-project tokens: none here.
        if "ampwatch_ingest_" not in target["expr"]
    ]  # fmt: skip
