"""`ampwatch demo` shows what it promises: each run's failure (or health) is in the data."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import httpx
import sqlalchemy as sa

from ampwatch.agent.wire import decode_float
from ampwatch.server.demo import run_demo
from ampwatch.server.serving import bind_socket


def _series(api: httpx.Client, run_id: int) -> dict[str, list]:
    raw = api.get(f"/api/v1/runs/{run_id}/steps").json()
    return {
        key: [decode_float(v) if key not in ("step", "skipped") else v for v in values]
        for key, values in raw.items()
        if isinstance(values, list)
    }  # not bucket_width


def _runs_by_name(api: httpx.Client) -> dict[str, dict]:
    return {run["name"]: run for run in api.get("/api/v1/runs").json()["runs"]}


def test_demo_runs_show_health_underflow_and_collapse(live_collector, tmp_path) -> None:
    run_demo(live_collector.url, steps=120, checkpoint_dir=tmp_path, quiet=True)
    with httpx.Client(base_url=live_collector.url, timeout=10) as api:
        _check_demo_runs(api, tmp_path)


def _check_demo_runs(api: httpx.Client, checkpoint_dir) -> None:
    deadline = time.monotonic() + 30
    while not all(r["status"] == "ended" for r in _runs_by_name(api).values()):
        assert time.monotonic() < deadline, "demo runs never ended"
        time.sleep(0.1)
    runs = _runs_by_name(api)
    assert set(runs) == {"demo-healthy", "demo-silent-underflow", "demo-divergence"}

    healthy = _series(api, runs["demo-healthy"]["id"])
    assert not any(healthy["skipped"])
    assert min(healthy["loss_scale"]) >= 2.0**16
    assert healthy["loss"][-1] < 0.8 * healthy["loss"][0]

    # Silent underflow: nothing looks wrong in the scalars ...
    underflow = _series(api, runs["demo-silent-underflow"]["id"])
    assert all(math.isfinite(v) for v in underflow["loss"])
    assert not any(underflow["skipped"])
    # ... while whole parameter tensors get exactly-zero gradients at every sample.
    matrix = api.get(
        f"/api/v1/runs/{runs['demo-silent-underflow']['id']}/layers",
        params={"stat": "zero_fraction"},
    ).json()
    frozen = [
        name
        for i, name in enumerate(matrix["layers"])
        if all(row[i] == 1.0 for row in matrix["values"])
    ]
    assert "blocks.0.0.weight" in frozen and "head.weight" not in frozen

    # Divergence: the activation norm climbs first, then the scale collapses below 1.0.
    diverged = _series(api, runs["demo-divergence"]["id"])
    first_skip = diverged["skipped"].index(True)
    assert diverged["loss_scale"][-1] < 1.0
    assert sum(diverged["skipped"][first_skip:]) > 0.9 * (len(diverged["step"]) - first_skip)
    baseline = diverged["act_norm_max"][0]
    assert max(diverged["act_norm_max"][:first_skip]) > 2 * baseline  # the precursor
    collapse = [v for v in diverged["act_norm_max"][first_skip:] if math.isfinite(v)]
    assert max(collapse) > 3 * baseline  # the spike as the scale falls
    events = api.get(f"/api/v1/runs/{runs['demo-divergence']['id']}/events").json()["events"]
    checkpoints = [e for e in events if e["kind"] == "checkpoint"]
    assert checkpoints and all(
        e["data"]["path"].startswith(str(checkpoint_dir)) for e in checkpoints
    )


def test_demo_command_starts_its_own_collector(tmp_path) -> None:
    """The console script end to end: no collector running, so it starts one."""
    with bind_socket() as probe:
        unused_port = probe.getsockname()[1]
    database_url = f"sqlite:///{tmp_path / 'demo.db'}"
    env = {**os.environ, "AMPWATCH_PORT": str(unused_port), "AMPWATCH_DATABASE_URL": database_url}
    done = subprocess.run(
        [sys.executable, "-m", "ampwatch.server.cli", "demo", "--steps", "20", "--exit"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert f"http://127.0.0.1:{unused_port}/dashboard/" in done.stdout
    assert "demo-divergence: step" in done.stdout
    engine = sa.create_engine(database_url)
    with engine.connect() as conn:
        names = conn.execute(sa.text("SELECT name FROM runs WHERE status = 'ended'")).scalars()
        assert sorted(names) == ["demo-divergence", "demo-healthy", "demo-silent-underflow"]
    engine.dispose()
