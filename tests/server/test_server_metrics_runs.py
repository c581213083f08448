"""Per-run series on `/metrics` (`ampwatch.server.run_metrics`): their values, which runs
have them, and the step totals they read (`run_step_totals`), exact however batches come."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import httpx
import numpy as np
import pytest
from alert_feed import Feed
from scraped import parse, promtool, scrape, series, value
from sqlalchemy import case, func, select, text, update
from wire_batches import make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH
from ampwatch.server import queries, run_metrics
from ampwatch.server.db import make_engine
from ampwatch.server.models import Run, utcnow
from ampwatch.server.step_models import Step


def post(url: str, batch: Any) -> httpx.Response:
    answer = httpx.post(url + INGEST_PATH, content=json.dumps(batch), timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


def steps(first: int, last: int, *, scale: float = 65536.0, skip_every: int = 0) -> list[Any]:
    return [
        step_record(s, loss=2.0, loss_scale=scale, skipped=bool(skip_every and s % skip_every == 0))
        for s in range(first, last + 1)
    ]


def test_a_runs_series_carry_its_values(collector: Any) -> None:
    batch = make_batch(0, client_run_id="r1", steps=steps(1, 100, skip_every=25))
    batch["steps"][-1] = step_record(100, loss=2.0, loss_scale=32768.0, skipped=True)
    batch["dropped"] = {"steps": 2, "layer_stats": 5, "events": 0}
    run_id = str(post(collector.url, batch).json()["run_id"])
    labels = {"project": "default", "run": "gpt-small", "run_id": run_id}

    healthy = parse(scrape(collector.url).text)
    assert value(healthy, "ampwatch_run_loss_scale", **labels) == 32768.0
    assert value(healthy, "ampwatch_run_last_step", **labels) == 100
    assert value(healthy, "ampwatch_run_steps_total", **labels) == 100
    assert value(healthy, "ampwatch_run_skipped_steps_total", **labels) == 4  # 25, 50, 75, 100
    assert value(healthy, "ampwatch_run_skip_ratio", **labels) == pytest.approx(0.04)
    assert value(healthy, "ampwatch_run_health", **labels) == 0
    assert value(healthy, "ampwatch_run_running", **labels) == 1
    assert 0 <= (value(healthy, "ampwatch_run_lag_seconds", **labels) or -1) < 60
    assert value(healthy, "ampwatch_run_agent_dropped_total", kind="steps", **labels) == 2
    assert value(healthy, "ampwatch_run_agent_dropped_total", kind="layer_stats", **labels) == 5
    assert not series(healthy, "ampwatch_run_alerts_firing")

    # The scale falls below 1.0: loss_scale_collapse (critical) fires at once.
    post(collector.url, make_batch(1, client_run_id="r1", steps=steps(101, 110, scale=0.5)))
    collapsed = parse(scrape(collector.url).text)
    assert value(collapsed, "ampwatch_run_loss_scale", **labels) == 0.5
    assert value(collapsed, "ampwatch_run_health", **labels) == 2
    firing = series(collapsed, "ampwatch_run_alerts_firing", **labels)
    assert firing == {
        frozenset({**labels, "rule": "loss_scale_collapse", "severity": "critical"}.items()): 1
    }


def test_non_finite_values_use_the_formats_spelling(collector: Any) -> None:
    post(collector.url, make_batch(0, client_run_id="nan", steps=steps(1, 3, scale=float("nan"))))
    post(collector.url, make_batch(0, client_run_id="inf", steps=steps(1, 3, scale=float("inf"))))
    text = scrape(collector.url).text
    assert "NaN\n" in text and "+Inf\n" in text
    assert " nan\n" not in text and " inf\n" not in text


def test_ended_runs_keep_their_series_for_the_window_and_the_cap_is_counted(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    with start_collector(db_url, dashboard=False, metrics_ended_window=600,
                         metrics_max_runs=2) as live:  # fmt: skip
        ids = {name: post(live.url, make_batch(0, client_run_id=name, steps=steps(1, 5)))
               .json()["run_id"] for name in ("live", "ended-now", "ended-long-ago")}  # fmt: skip
        for name in ("ended-now", "ended-long-ago"):
            httpx.post(f"{live.url}/api/v1/runs/{ids[name]}/end", timeout=30).raise_for_status()
        engine = make_engine(db_url)
        with engine.begin() as connection:
            connection.execute(update(Run).where(Run.id == ids["ended-long-ago"])
                               .values(last_seen_at=utcnow() - timedelta(hours=2)))  # fmt: skip
        engine.dispose()
        samples = parse(scrape(live.url).text)
        running = {dict(k)["run_id"]: v for k, v in series(samples, "ampwatch_run_running").items()}
        assert running == {str(ids["live"]): 1, str(ids["ended-now"]): 0}
        lagging = {dict(k)["run_id"] for k in series(samples, "ampwatch_run_lag_seconds")}
        assert lagging == {str(ids["live"])}  # an ended run has no lag
        assert value(samples, "ampwatch_metrics_runs_omitted") == 0

        post(live.url, make_batch(0, client_run_id="another-live", steps=steps(1, 5)))
        capped = parse(scrape(live.url).text)
        shown = {dict(k)["run_id"] for k in series(capped, "ampwatch_run_running")}
        assert len(shown) == 2 and str(ids["ended-now"]) not in shown  # running ones first
        assert value(capped, "ampwatch_metrics_runs_omitted") == 1


def test_every_family_follows_the_naming_conventions() -> None:
    for family in run_metrics.FAMILIES:
        assert family.name.startswith("ampwatch_run_")
        assert family.name.endswith("_total") == (family.kind == "counter"), family.name
        assert "layer" not in family.name


def test_promtool_accepts_the_exposition(collector: Any) -> None:
    tool = promtool()
    if tool is None:
        pytest.skip("promtool is not installed (Debian package prometheus: make test installs it)")
    post(collector.url, make_batch(0, client_run_id="a", steps=steps(1, 50, skip_every=7)))
    post(collector.url, make_batch(1, client_run_id="a", steps=steps(51, 60, scale=0.25)))
    post(collector.url, make_batch(0, client_run_id="b", steps=steps(1, 3, scale=float("nan"))))
    httpx.post(f"{collector.url}/api/v1/runs", json={"client_run_id": "c", "name": 'q "x"\\'},
               timeout=30).raise_for_status()  # fmt: skip
    text = scrape(collector.url).text
    assert 'rule="loss_scale_collapse"' in text
    checked = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, check=False,
                             text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.strip() == "" and checked.stderr.strip() == "", checked.stderr


def _direct_summary(feed: Feed) -> tuple[int, int, int]:
    """(steps, skipped, last step) from the raw `steps` rows: per rank, the rank with most."""
    with feed.sessions() as session:
        run_id = feed.run().id
        per_rank = session.execute(
            select(func.count(), func.sum(case((Step.skipped, 1), else_=0)), func.max(Step.step))
            .where(Step.run_id == run_id)
            .group_by(Step.rank)
        ).all()
    return (max(r[0] for r in per_rank), max(int(r[1]) for r in per_rank),
            max(r[2] for r in per_rank))  # fmt: skip


def test_step_totals_stay_exact_across_resends_resumes_and_ranks(feed: Feed) -> None:
    rng = np.random.default_rng(7)
    for _ in range(40):
        first = int(rng.integers(1, 3000))
        span = int(rng.integers(1, 300))
        rank = int(rng.integers(0, 2))
        feed.send([step_record(s, rank=rank, loss=1.0, loss_scale=1024.0,
                               skipped=bool(rng.random() < 0.2))
                   for s in range(first, first + span)])  # fmt: skip
    steps_total, skipped, last_step = _direct_summary(feed)
    with feed.sessions() as session:
        run = queries.get_run(session, feed.run().id)
    assert run is not None
    assert (run.steps, run.skipped_steps, run.last_step) == (steps_total, skipped, last_step)


def test_the_skip_ratio_covers_the_last_16_rollups_of_a_long_run(feed: Feed) -> None:
    skipped = {s for s in range(1, 5001) if s % 13 == 0 or 4000 < s < 4100}
    records = [step_record(s, loss=1.0, loss_scale=1024.0, skipped=s in skipped)
               for s in range(1, 5001)]  # fmt: skip
    feed.send_steps(records, per_batch=1000)
    latest = 5000 // 64 * 64
    window = [s for s in range(1, 5001) if s >= latest - 15 * 64]
    expected = sum(s in skipped for s in window) / len(window)
    with feed.sessions() as session:
        rates = queries.skip_rates(session, [feed.run().id])
    assert rates == {feed.run().id: pytest.approx(expected)}


def test_0008_sums_the_totals_of_existing_runs(db_url: str) -> None:
    """Runs stored before revision 0008 get their step totals from their rollups."""
    from ampwatch.server.migrate import upgrade

    upgrade(db_url, "0006")
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO runs (id, client_run_id, name, project, status, created_at,"
                " last_seen_at, dropped_steps, dropped_layer_stats, dropped_events, health)"
                " VALUES (1, 'r', 'r', 'default', 'running', CURRENT_TIMESTAMP,"
                " CURRENT_TIMESTAMP, 0, 0, 0, 'ok')"))  # fmt: skip
            for rank, start, last, count, skipped in ((0, 0, 63, 63, 2), (0, 64, 100, 37, 1),
                                                      (1, 0, 40, 40, 2)):  # fmt: skip
                connection.execute(text(
                    "INSERT INTO step_rollups (run_id, rank, bucket_start, first_step, last_step,"
                    " skipped_count, step_count) VALUES (1, :r, :b, :b, :l, :s, :c)"),
                    {"r": rank, "b": start, "l": last, "s": skipped, "c": count})  # fmt: skip
        upgrade(db_url)
        with engine.connect() as connection:
            totals = connection.execute(
                text(
                    "SELECT rank, steps, skipped_steps, last_step FROM run_step_totals ORDER BY rank"
                )
            )
            assert [tuple(row) for row in totals] == [(0, 100, 3, 100), (1, 40, 2, 40)]
    finally:
        engine.dispose()
