"""The FP8 readiness scenario shared by the collector and dashboard tests: a real CPU
training loop whose layer 2 has three outlier output channels (2^22 times the others) and
whose layer 0 is ordinary, watched by the real agent (FP8 samples at steps 1, 4, 7), or its
FP8 records alone (`outlier_records`) for the alert engine's tests."""

from __future__ import annotations

import torch
from torch import nn

from ampwatch.agent import watch
from ampwatch.agent.fp8 import Fp8Monitor
from ampwatch.agent.transport import http_transport
from ampwatch.agent.wire import LayerStatsRecord

OUTLIER_ROWS = [3, 70, 200]
SAMPLED = [1, 4, 7]


def outlier_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 160), nn.ReLU(), nn.Linear(160, 256))
    with torch.no_grad():
        model[2].weight[OUTLIER_ROWS] *= 2.0**22
    return model


def train_outlier_run(url: str, run_id: str = "fp8") -> nn.Module:
    """Seven FP32 SGD steps against the collector at `url`, declaring the per-tensor recipe."""
    model = outlier_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with watch(model, optimizer, transport=http_transport(url), run_id=run_id,
               fp8_stats_every=3, fp8_recipe="per_tensor", flush_interval=0.05):  # fmt: skip
        for _ in range(7):
            model(torch.randn(32, 64)).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


def outlier_records(
    steps: int, every: int, *, heal_at: int | None = None
) -> list[LayerStatsRecord]:
    """The real agent's FP8 records (`Fp8Monitor`, no transport) of the outlier model's SGD
    steps 1..`steps`, sampled every `every`; from step `heal_at` on, the outlier channels
    are scaled back to the others' size, so that layer fits per-tensor scaling again."""
    model = outlier_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    errors: list[BaseException] = []
    monitor = Fp8Monitor(model, every=every, on_error=errors.append,
                         to_host=lambda t: (t.clone(), None))  # fmt: skip
    records: list[LayerStatsRecord] = []
    for step in range(1, steps + 1):
        if step == heal_at:
            with torch.no_grad():
                model[2].weight[OUTLIER_ROWS] /= 2.0**22
        model(torch.randn(32, 64)).mean().backward()
        sample = monitor.after_step(step)
        optimizer.step()
        optimizer.zero_grad()
        if sample is not None:
            records.extend(sample.records())
    assert not errors, errors
    return records
