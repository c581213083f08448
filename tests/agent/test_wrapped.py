"""Wrapped objects are unwrapped at attach; an unsupported one is a TypeError that says
what is supported, never an AttributeError from inside the agent."""

from __future__ import annotations

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch


def test_an_unsupported_optimizer_is_a_type_error_naming_what_is_supported(
    collector: FakeCollector,
) -> None:
    class NotAnOptimizer:
        def step(self) -> None: ...

    with pytest.raises(TypeError, match="AcceleratedOptimizer") as error:
        watch(nn.Linear(2, 2), NotAnOptimizer(), transport=collector)  # type: ignore[arg-type]
    assert "NotAnOptimizer" in str(error.value)


def test_a_closure_step_is_measured_after_the_closure(collector: FakeCollector) -> None:
    """Lightning-style `step(closure)`: the closure runs backward, so the stored norm and
    loss are this step's, not the previous one's (a spike shows at its own step)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    handle = watch(model, optimizer, transport=collector, layer_stats_every=1)
    norms = []
    for step in range(1, 6):
        x = torch.randn(8, 4) * (1e3 if step == 3 else 1.0)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        # the grads before step() are the previous step's: a pre-step read would be wrong
        optimizer.step(closure)
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
    handle.detach()
    assert collector.column("grad_norm") == norms
    assert max(range(5), key=lambda i: collector.column("grad_norm")[i]) == 2
    assert all(v is not None for v in collector.column("loss"))  # the closure's loss
    assert collector.column("skipped") == [False] * 5
