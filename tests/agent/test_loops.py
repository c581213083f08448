"""Loop shapes beyond the single-optimizer recipe: several optimizers, gradient accumulation."""

from __future__ import annotations

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch


def test_two_optimizers_one_scaler_record_one_step_per_update(collector: FakeCollector) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.AdamW(model[2].parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    handle = watch(model, [body, head], scaler, transport=collector, layer_stats_every=1)
    skipped, scales = [], []
    for step in range(6):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 6)).float().pow(2).mean()
            if step == 2:
                loss = loss * 1e30
        scaler.scale(loss).backward()
        scaler.step(body)
        scaler.step(head)
        flags = [*scaler._found_inf_per_device(body).values()]
        flags += [*scaler._found_inf_per_device(head).values()]
        skipped.append(any(f.item() > 0 for f in flags))
        scales.append(scaler.get_scale())
        scaler.update()
        body.zero_grad()
        head.zero_grad()
    handle.detach()
    for optimizer in (body, head):
        assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert "update" not in scaler.__dict__ and "scale" not in scaler.__dict__

    assert collector.column("step") == [1, 2, 3, 4, 5, 6]
    assert collector.column("skipped") == skipped == [False, False, True, False, False, False]
    assert collector.column("loss_scale") == scales
    assert collector.column("lr") == [0.1] * 6  # the first optimizer's first group
    start = collector.events("run_start")[0]["data"]
    assert [o["class"] for o in start["optimizers"]] == ["SGD", "AdamW"]
    assert start["optimizers"][1]["fused"] is True
    assert collector.layer_stats()[0]["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_both_optimizers_are_guarded_against_a_second_watch(collector: FakeCollector) -> None:
    model = nn.Linear(2, 2)
    first = torch.optim.SGD([model.weight], lr=0.1)
    second = torch.optim.SGD([model.bias], lr=0.1)
    handle = watch(model, [first, second], transport=collector)
    with pytest.raises(RuntimeError, match="already watched"):
        watch(nn.Linear(2, 2), second, transport=collector)
    handle.detach()
    with pytest.raises(TypeError, match="list of them"):
        watch(model, [first, "sgd"], transport=collector)  # type: ignore[list-item]


@pytest.mark.parametrize("with_scaler", [True, False])
def test_gradient_accumulation_records_once_per_optimizer_step(
    with_scaler: bool, collector: FakeCollector
) -> None:
    torch.manual_seed(1)
    model = nn.Linear(5, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu") if with_scaler else None
    handle = watch(model, optimizer, scaler, transport=collector, layer_stats_every=1)
    micro_batches, steps = 4, 3
    expected_losses, expected_norms = [], []
    for _ in range(steps):
        losses = []
        for _ in range(micro_batches):
            with torch.autocast("cpu", dtype=torch.float16, enabled=with_scaler):
                loss = model(torch.randn(2, 5)).float().pow(2).mean() / micro_batches
            losses.append(loss.item())
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                handle.log_loss(loss)
                loss.backward()
        expected_losses.append(sum(losses) / micro_batches)
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        expected_norms.append(norm.item())
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    handle.detach()

    assert collector.column("step") == [1, 2, 3]
    assert collector.column("loss") == pytest.approx(expected_losses, rel=1e-6)
    assert collector.column("grad_norm") == expected_norms  # the accumulated, unscaled grads
    assert [r["step"] for r in collector.layer_stats()] == [1, 2, 3]
    assert all(r["rank"] == 0 for r in collector.steps() + collector.layer_stats())
