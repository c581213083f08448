"""Adam's second-moment lag and update/weight ratio (`agent/precursors.py`): the values the
agent sends every step equal an independent computation from the optimizer's own state,
for plain, foreach and fused AdamW under a real FP16 GradScaler on the CPU, and reading
them calls no `.item()` / `.tolist()` / `float()` on a tensor (no host sync)."""

from __future__ import annotations

import math

import pytest
import torch
from agent_fakes import FakeCollector
from torch import nn

from ampwatch.agent import watch
from ampwatch.agent.precursors import adam_precursors


def _truth(optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """Wortsman et al.'s RMS and ||update|| / ||w||, element by element in float64."""
    rms, ratio = [], []
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            state = optimizer.state[p]
            t = float(state["step"])
            v_hat = state["exp_avg_sq"].double() / (1 - beta2**t)
            m_hat = state["exp_avg"].double() / (1 - beta1**t)
            g = p.grad.double()
            rms.append(math.sqrt(float((g * g / v_hat.clamp_min(group["eps"] ** 2)).mean())))
            update = group["lr"] * m_hat / v_hat.sqrt().clamp_min(group["eps"])
            ratio.append(float(update.norm() / p.detach().double().norm()))
    return max(rms), max(ratio)


@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
def test_sent_precursors_equal_the_optimizers_state(kind: str, collector: FakeCollector) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    options = {"plain": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), **options[kind])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    handle = watch(model, optimizer, scaler=scaler, transport=collector, layer_stats_every=1)
    truth = []
    for step in range(6):
        optimizer.zero_grad()
        x = torch.randn(8, 16) * (1 + 4 * (step == 5))  # the last step's gradient jumps
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        truth.append(_truth(optimizer))  # grads unscaled, state updated: what the agent reads
        scaler.update()
    handle.detach()

    rms = collector.column("adam_rms_max")
    ratio = collector.column("update_ratio_max")
    assert rms == pytest.approx([t[0] for t in truth], rel=1e-4)
    assert ratio == pytest.approx([t[1] for t in truth], rel=1e-4)
    assert rms[0] == pytest.approx(1.0, rel=1e-4)  # t = 1: v_hat is g^2 itself
    assert rms[-1] > 1.5 * max(rms[1:-1])  # the second moment lags the jump


def test_no_adam_state_sends_no_precursor(collector: FakeCollector) -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = watch(model, optimizer, transport=collector)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    handle.detach()
    (record,) = collector.steps()
    assert "adam_rms_max" not in record and "update_ratio_max" not in record


@pytest.mark.parametrize("kind", [{"foreach": True}, {"fused": True}])
def test_nothing_is_read_on_the_host(
    kind: dict[str, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every host read a tensor offers is recorded while the precursors are taken: there is
    none, not even of the state's CPU `step` or a tensor `lr` (the training thread's host
    reads are counted in test_cost); gradients, moments and results stay on the device
    until the step's stacked copy."""
    model = nn.Linear(8, 8)
    lr = torch.tensor(1e-3) if kind.get("fused") else 1e-3  # foreach takes no tensor lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **kind)
    model(torch.randn(2, 8)).pow(2).sum().backward()
    optimizer.step()
    read: list[int] = []

    def recording(name: str) -> object:
        original = getattr(torch.Tensor, name)

        def method(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            read.append(id(self))
            return original(self, *args, **kwargs)

        return method

    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, recording(name))
    values = adam_precursors([optimizer])
    assert set(adam_precursors([optimizer], update_ratio=False)) == {"adam_rms_max"}
    monkeypatch.undo()
    assert read == []
    assert set(values) == {"adam_rms_max", "update_ratio_max"}
    assert float(values["adam_rms_max"]) == pytest.approx(1.0, rel=1e-4)
