"""Megatron-core's own loss scaler through the manual path (`agent/manual.py`'s Megatron
example), where megatron-core imports: 0.17 and later need Python 3.12; 0.16.1, the last
release for 3.11, imports on the CPU but allocates its scale with `device="cuda"`, so the
scaler is built here with that one argument dropped (its `update()`, hysteresis and floor
are Megatron's code as released). The unscale and found-inf check are the ones Megatron's
`MixedPrecisionOptimizer` runs (`torch._amp_foreach_non_finite_check_and_unscale_`).
Truth: the scaler's own scale before each step and the optimizer's step counter."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch

grad_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler")

OVERFLOWS = {2, 3, 7}  # two in a row: Megatron's hysteresis=2 backs off on the second


def _on_cpu(make: Any) -> Any:
    """Build a Megatron scaler with its tensors on the CPU instead of CUDA."""
    real = torch.tensor
    with mock.patch.object(torch, "tensor", lambda *a, device=None, **k: real(*a, **k)):
        return make()


def test_megatron_dynamic_grad_scaler_through_the_manual_path() -> None:
    collector = FakeCollector()
    scaler = _on_cpu(
        lambda: grad_scaler.DynamicGradScaler(
            initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
            growth_interval=3, hysteresis=2,
        )
    )  # fmt: skip
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    handle = watch(model, transport=collector, min_loss_scale=1.0)
    scales, counters, norms = [], [], []
    for step in range(10):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss_scale = scaler.scale  # a device tensor of shape [1]: passed as is
        scales.append(loss_scale.item())
        (loss * loss_scale).backward()
        if step in OVERFLOWS:
            assert model.weight.grad is not None
            model.weight.grad[0, 0] = float("inf")  # as an FP16 overflow leaves it
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        found_inf = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, scaler.inv_scale)
        skipped = bool(found_inf.item())
        scaler.update(skipped)
        grad_norm = torch.nn.utils.get_total_norm(grads)
        norms.append(grad_norm.item())
        if not skipped:  # Megatron's optimizer.step() returns update_successful
            optimizer.step()
        optimizer.zero_grad()
        state = optimizer.state.get(model.weight, {})
        counters.append(int(state["step"]) if "step" in state else 0)
        handle.record(
            loss=loss.detach(), loss_scale=loss_scale, skipped=skipped, grad_norm=grad_norm
        )
    handle.detach()

    truth_skipped = [after == before for before, after in zip([0, *counters], counters)]
    assert truth_skipped == [step in OVERFLOWS for step in range(10)]
    assert collector.column("skipped") == truth_skipped
    assert collector.column("loss_scale") == scales
    assert scales[:5] == [2.0**16] * 3 + [2.0**16, 2.0**15]  # backed off after the 2nd
    assert collector.column("grad_norm") == norms
