"""Settings: explicit arguments, then AMPWATCH_* variables, then defaults."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch
from ampwatch.agent.config import DEFAULT_LAYER_STATS_EVERY, DEFAULT_URL, resolve
from ampwatch.agent.spool import read_frames

ENV = {
    "AMPWATCH_URL": "http://collector:9000",
    "AMPWATCH_TOKEN": "secret",
    "AMPWATCH_RUN": "env-run",
    "AMPWATCH_RUN_ID": "job-42",
    "AMPWATCH_PROJECT": "env-project",
    "AMPWATCH_LAYER_STATS_EVERY": "7",
    "AMPWATCH_OFFLINE_FILE": "/tmp/run.ampwatch",
}


def test_environment_fills_what_arguments_leave_out() -> None:
    settings = resolve(environ=ENV)
    assert (settings.url, settings.token, settings.run) == (
        "http://collector:9000",
        "secret",
        "env-run",
    )
    assert (settings.run_id, settings.project, settings.layer_stats_every) == (
        "job-42",
        "env-project",
        7,
    )
    assert settings.offline_file == "/tmp/run.ampwatch" and settings.enabled


def test_explicit_arguments_win() -> None:
    settings = resolve(url="http://x", token="t", project="p", layer_stats_every=3, environ=ENV)
    assert (settings.url, settings.token, settings.project) == ("http://x", "t", "p")
    assert settings.layer_stats_every == 3


def test_defaults() -> None:
    settings = resolve(environ={})
    assert settings.url == DEFAULT_URL and settings.token is None and settings.run is None
    assert settings.layer_stats_every == DEFAULT_LAYER_STATS_EVERY == 20
    assert settings.project is None and settings.enabled


def test_an_unset_project_is_left_to_the_token(collector: FakeCollector) -> None:
    """A project token files the run under its own project; naming "default" would be a 403."""
    watch(nn.Linear(2, 2), transport=collector).detach()
    assert "project" not in collector.batches[0]["run"]


def test_disabled_is_a_kill_switch_and_bad_values_name_the_variable() -> None:
    assert not resolve(enabled=True, environ={"AMPWATCH_DISABLED": "yes"}).enabled
    assert not resolve(enabled=False, environ={}).enabled
    with pytest.raises(ValueError, match="AMPWATCH_LAYER_STATS_EVERY"):
        resolve(environ={"AMPWATCH_LAYER_STATS_EVERY": "often"})


def test_watch_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch, collector: FakeCollector
) -> None:
    for name in ("AMPWATCH_RUN", "AMPWATCH_RUN_ID", "AMPWATCH_PROJECT"):
        monkeypatch.setenv(name, ENV[name])
    monkeypatch.setenv("AMPWATCH_LAYER_STATS_EVERY", "2")
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = watch(model, optimizer, transport=collector, project="arg-project")
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    handle.detach()
    assert collector.batches[0]["run"] == {
        "client_run_id": "job-42",
        "name": "env-run",
        "project": "arg-project",
    }
    assert [r["step"] for r in collector.layer_stats()] == [1, 3]


def test_the_token_reaches_the_transport_as_a_bearer_header(
    monkeypatch: pytest.MonkeyPatch, collector: FakeCollector
) -> None:
    monkeypatch.setenv("AMPWATCH_TOKEN", "s3cret")
    watch(nn.Linear(2, 2), transport=collector).detach()
    assert collector.headers[0]["Authorization"] == "Bearer s3cret"


def test_an_offline_file_from_the_environment_gets_every_batch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "run.ampwatch"
    monkeypatch.setenv("AMPWATCH_OFFLINE_FILE", str(path))
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = watch(model, optimizer)  # no transport, no network
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    handle.detach()
    batches = [json.loads(gzip.decompress(body)) for body in read_frames(path) if body]
    assert [s["step"] for b in batches for s in b["steps"]] == [1]
    assert [e["kind"] for b in batches for e in b["events"]] == ["run_start", "run_end"]
