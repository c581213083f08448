"""The lr of every param group: agent -> real collector (SQLite and PostgreSQL) -> /steps."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch

STEPS = 6


def _train(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    handle: Any,
    scaler: torch.amp.GradScaler,
) -> list[list[float]]:
    """A real FP16 autocast CPU loop; returns every group's lr as each step used it."""
    truth = []
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        truth.append([g["lr"] for o in optimizers for g in o.param_groups])
        for optimizer in optimizers:
            optimizer.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
    handle.detach(timeout=20)
    return truth


def _two_groups(model: nn.Sequential) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 1e-3},
            {"params": model[2].parameters(), "lr": 1e-4, "weight_decay": 0.0},
        ]
    )
    # Each group on its own schedule: what `lr` alone (group 0) cannot show.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 0.5**s, lambda s: 1.0 + s])
    return optimizer, schedule


def test_two_param_groups_reach_the_steps_endpoint(
    db_url: str, start_collector: Callable[..., AbstractContextManager[Any]]
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    single = nn.Linear(8, 2)
    optimizer, schedule = _two_groups(model)
    with start_collector(db_url, dashboard=False) as live:
        scaler = torch.amp.GradScaler("cpu")
        handle = watch(model, optimizer, scaler, run_id="groups", url=live.url, flush_interval=0.05)
        truth = _train(model, [optimizer], [schedule], handle, scaler)
        one = torch.optim.SGD(single.parameters(), lr=0.1)
        single_scaler = torch.amp.GradScaler("cpu")
        handle = watch(single, one, single_scaler, run_id="one-group", url=live.url)
        _train(single, [one], [], handle, single_scaler)

        with httpx.Client(base_url=f"{live.url}/api/v1", timeout=30) as http:
            ids = {r["client_run_id"]: r["id"] for r in http.get("/runs").json()["runs"]}
            steps = http.get(f"/runs/{ids['groups']}/steps").json()
            assert steps["step"] == list(range(1, STEPS + 1))
            assert steps["lr_groups"] == truth
            assert steps["lr"] == [lrs[0] for lrs in truth]
            assert len({lrs[0] / lrs[1] for lrs in truth}) == STEPS  # the schedules differ
            # Downsampled answers carry no per-group lr (documented on StepSeries).
            coarse = http.get(f"/runs/{ids['groups']}/steps", params={"max_points": 2}).json()
            assert coarse["bucket_width"] > 1
            assert coarse["lr_groups"] == [None] * len(coarse["step"])
            # One param group: `lr` alone, as before.
            plain = http.get(f"/runs/{ids['one-group']}/steps").json()
            assert plain["lr_groups"] == [None] * STEPS and plain["lr"] == [0.1] * STEPS


def test_several_optimizers_send_all_their_groups_in_order(collector: FakeCollector) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    first, schedule = _two_groups(model)
    second = torch.optim.SGD(model[0].parameters(), lr=0.25)
    scaler = torch.amp.GradScaler("cpu")
    handle = watch(model, [first, second], scaler, transport=collector, flush_interval=0.05)
    truth = _train(model, [first, second], [schedule], handle, scaler)
    steps = collector.steps()
    assert [s["lr_groups"] for s in steps] == truth
    assert all(len(lrs) == 3 and lrs[2] == 0.25 for lrs in truth)
    assert [s["lr"] for s in steps] == [lrs[0] for lrs in truth]
