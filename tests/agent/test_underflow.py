"""The seed's worked example through the agent: a pure-FP16 model whose true gradients are
about 1e-8, below FP16's smallest subnormal (2**-24 ~ 6e-8), so they flush to exactly zero;
a static loss scale of 1024 lifts them back into range."""

from __future__ import annotations

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch


def _zero_fractions_with_static_scale(scale: float, collector: FakeCollector) -> list[float]:
    torch.manual_seed(0)
    model = nn.Linear(256, 4, bias=False).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    handle = watch(model, optimizer, transport=collector, layer_stats_every=2)
    for _ in range(4):
        x = (torch.rand(1, 256) + 0.5).mul(1e-4).half()  # activations ~1e-4
        loss = model(x).sum() * 1e-4  # dL/dW = 1e-4 * x ~ 1e-8 per element
        (loss * scale).backward()
        optimizer.step()  # measured in the step PRE-hook: the grads the optimizer applies
        optimizer.zero_grad()
    handle.detach()
    return [r["stats"]["zero_fraction"][0] for r in collector.layer_stats()]


def test_unscaled_fp16_gradients_of_1e_8_are_all_zero(collector: FakeCollector) -> None:
    assert _zero_fractions_with_static_scale(1.0, collector) == [1.0, 1.0]
    (finding,) = collector.events("finding")
    assert finding["data"]["code"] == "fp16_params_without_scaler"
    assert finding["data"]["params"] == ["weight"]


def test_static_scale_1024_recovers_them(collector: FakeCollector) -> None:
    fractions = _zero_fractions_with_static_scale(1024.0, collector)
    assert fractions == pytest.approx([0.0, 0.0], abs=0.01)
