"""Agent → real HTTP collector → database: what is stored equals what the loop saw.

A small model trains in FP16 autocast on the CPU with a real `GradScaler`, with overflows
forced on chosen steps. The loop records its own ground truth (the scaler's found-inf
between `step()` and `update()`, the scale in effect, the gradients' zero fractions);
the test then reads the collector's database and compares.
"""

from __future__ import annotations

import math
import time

import httpx
import pytest
import sqlalchemy as sa
import torch
from torch import nn

from ampwatch.agent import watch

STEPS = 240
LAYER_STATS_EVERY = 5
FORCED_OVERFLOW_STEPS = {3, 4, 5, 60, 61, 130, 200}  # 1-based optimizer steps


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(64, 32),
        nn.Linear(32, 64),
        nn.ReLU(),  # dead units give some exactly-zero gradient elements
        nn.Linear(64, 32),
        nn.LayerNorm(32),
        nn.Linear(32, 64),
    )


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the collector to hold the run")
        time.sleep(0.1)


def test_database_holds_what_the_training_loop_saw(live_collector) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=20)
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(1)

    truth_skipped: list[bool] = []
    truth_scale: list[float] = []
    truth_zero: dict[int, dict[str, float]] = {}
    with watch(
        model,
        optimizer,
        scaler,
        run="e2e",
        url=live_collector.url,
        layer_stats_every=LAYER_STATS_EVERY,
        flush_interval=0.2,
    ) as handle:
        for step in range(1, STEPS + 1):
            tokens = torch.randint(0, 64, (8, 16), generator=generator)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(tokens)
            loss = loss_fn(logits.float().view(-1, 64), tokens.view(-1))
            if step in FORCED_OVERFLOW_STEPS:
                loss = loss * 1e30  # scaled FP16 gradients overflow to inf
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            found_inf = sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())
            truth_skipped.append(found_inf > 0)
            truth_scale.append(scaler.get_scale())
            scaler.update()
            if (step - 1) % LAYER_STATS_EVERY == 0:
                truth_zero[step] = {
                    name: (p.grad == 0).double().mean().item()
                    for name, p in model.named_parameters()
                }
            optimizer.zero_grad(set_to_none=True)
        run_id = handle.client_run_id

    assert sum(truth_skipped) >= len(FORCED_OVERFLOW_STEPS), "overflows were not forced"

    with httpx.Client(base_url=live_collector.url, timeout=10) as api:
        _check_stored(
            api, live_collector.database_url, run_id, model, truth_skipped, truth_scale, truth_zero
        )


def _check_stored(api, database_url, run_id, model, truth_skipped, truth_scale, truth_zero) -> None:
    runs = api.get("/api/v1/runs").json()["runs"]
    run = next(r for r in runs if r["client_run_id"] == run_id)
    _wait_for(lambda: api.get(f"/api/v1/runs/{run['id']}").json()["status"] == "ended")

    engine = sa.create_engine(database_url)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT step, skipped FROM steps WHERE run_id = :r ORDER BY step"),
            {"r": run["id"]},
        ).all()
        stored_skips = conn.execute(
            sa.text("SELECT count(*) FROM steps WHERE run_id = :r AND skipped"),
            {"r": run["id"]},
        ).scalar_one()
    engine.dispose()
    assert [r.step for r in rows] == list(range(1, STEPS + 1))
    assert stored_skips == sum(truth_skipped)
    assert [bool(r.skipped) for r in rows] == truth_skipped

    series = api.get(f"/api/v1/runs/{run['id']}/steps").json()
    assert series["step"] == list(range(1, STEPS + 1))
    assert series["loss_scale"] == truth_scale
    assert series["skipped"] == truth_skipped
    forced_losses = [series["loss"][s - 1] for s in sorted(FORCED_OVERFLOW_STEPS)]
    assert all(isinstance(v, float) and v > 1e29 for v in forced_losses)

    matrix = api.get(f"/api/v1/runs/{run['id']}/layers", params={"stat": "zero_fraction"}).json()
    assert matrix["steps"] == sorted(truth_zero)
    assert matrix["layers"] == [name for name, _ in model.named_parameters()]
    for step, row in zip(matrix["steps"], matrix["values"]):
        expected = [truth_zero[step][name] for name in matrix["layers"]]
        assert row == pytest.approx(expected, abs=1e-12), f"step {step}"
    # The ReLU and the embedding rows the batch never touches make real zeros somewhere.
    assert any(v > 0 for row in matrix["values"] for v in row if not math.isnan(v))

    kinds = [e["kind"] for e in api.get(f"/api/v1/runs/{run['id']}/events").json()["events"]]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
