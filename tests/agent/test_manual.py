"""The manual API, for loops whose loss scaler is not torch's."""

from __future__ import annotations

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch


def test_record_takes_numbers_and_tensors(collector: FakeCollector) -> None:
    model = nn.Linear(2, 2)
    handle = watch(model, transport=collector)  # no optimizer: manual mode
    handle.record(loss=2.5, loss_scale=65536, skipped=False, grad_norm=1.25, lr=1e-3)
    handle.record(
        loss=torch.tensor(float("nan")),
        loss_scale=torch.tensor(32768.0),
        skipped=torch.tensor(True),
        grad_norm=torch.tensor([3.0]),
    )
    handle.record(step=10, skipped=True)
    handle.detach()

    assert collector.column("step") == [1, 2, 10]
    assert collector.column("skipped") == [False, True, True]
    assert collector.column("loss_scale") == [65536.0, 32768.0, None]
    assert collector.column("grad_norm") == [1.25, 3.0, None]
    assert collector.column("lr") == [1e-3, None, None]
    assert collector.steps()[1]["loss"] == "NaN"
    assert handle.step == 10
    assert collector.events("run_start")[0]["data"]["mode"] == "manual"
    assert collector.events("run_start")[0]["data"]["min_loss_scale"] is None  # not reported


def test_the_scalers_floor_goes_in_run_start_and_is_checked_at_attach(
    collector: FakeCollector,
) -> None:
    watch(nn.Linear(2, 2), transport=collector, min_loss_scale=1e-4).detach()
    assert collector.events("run_start")[0]["data"]["min_loss_scale"] == 1e-4
    bad = ((0.0, ValueError), (float("inf"), ValueError), (-1, ValueError),
           ("1e-4", TypeError), (True, TypeError))  # fmt: skip
    for value, error in bad:
        with pytest.raises(error, match="min_loss_scale"):
            watch(nn.Linear(2, 2), transport=collector, min_loss_scale=value)


def test_record_never_raises(collector: FakeCollector) -> None:
    handle = watch(nn.Linear(2, 2), transport=collector)
    handle.record(loss="high")  # type: ignore[arg-type]
    handle.record(loss=torch.ones(3))  # not a scalar
    handle.record(step="x")  # type: ignore[arg-type]
    handle.detach()
    handle.record(loss=1.0)  # after detach: nothing
    assert handle.counters["hook_errors"] == 3
    assert collector.steps() == []


def test_a_scaler_without_an_optimizer_is_an_error() -> None:
    with pytest.raises(ValueError, match="optimizer"):
        watch(nn.Linear(2, 2), None, torch.amp.GradScaler("cpu"))


def test_record_adds_the_activation_norm_and_logged_loss(collector: FakeCollector) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    handle = watch(model, transport=collector)
    x = torch.randn(5, 3)
    loss = model(x).pow(2).mean()
    handle.log_loss(loss)
    handle.record(loss_scale=8.0)
    handle.record()  # nothing measured since: no activation norm, no loss
    handle.detach()
    with torch.no_grad():
        norms = torch.linalg.vector_norm(model[0](x), dim=-1)
    first, second = collector.steps()
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert first["act_norm_max"] == pytest.approx(norms.max().item(), rel=1e-5)
    assert second["loss"] is None and second["act_norm_mean"] is None
