"""accelerate 1.x on the CPU against a live collector: `watch(model, optimizer,
accelerator=accelerator)` on the prepared (wrapped) objects, compared step by step with
accelerate's own ground truth (the norm its `clip_grad_norm_` returns, before clipping;
the optimizer's step counter, which does not move on a skip; the scaler's scale).

On the CPU accelerate builds no GradScaler and no FP16 autocast (`native_amp` is False
there): the FP16 cases set `accelerator.scaler = GradScaler("cpu")` and `native_amp =
True` before `prepare()`, which is exactly what accelerate does on a GPU, to reach the FP16
path. bf16 is accelerate's own CPU path (autocast entered inside the model's forward).
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from framework_truth import Truth, assert_matches, stored_run
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ampwatch.agent import watch

EVERY = 7
SPIKE = 1e6

CASES = {
    # name: (precision, fused, accumulation, optimizer steps)
    "acc-fp16-unfused-acc1": ("fp16", False, 1, 200),
    "acc-fp16-unfused-acc4": ("fp16", False, 4, 75),
    "acc-bf16-fused-acc4": ("bf16", True, 4, 75),
    "acc-bf16-unfused-acc1": ("bf16", False, 1, 200),
    # clipping by value (`accelerator.clip_grad_value_`): the stored norm is before it
    "acc-fp16-unfused-acc4-value": ("fp16", False, 4, 50),
}
#: The value clip of the "-value" cases: below most gradient entries, so it clips.
CLIP_VALUE = 0.01


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide state; each case builds its own (as its tests do)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("case", list(CASES))
def test_accelerate_loop_is_stored_exactly(case: str, live_collector) -> None:
    precision, fused, accumulation, steps = CASES[case]
    torch.manual_seed(0)
    batches = steps * accumulation
    data = TensorDataset(torch.randn(batches * 8, 16), torch.randn(batches * 8, 4))
    spikes = {3, 40, 41, 42, batches - 5}
    accelerator = Accelerator(
        mixed_precision=precision, gradient_accumulation_steps=accumulation, cpu=True
    )
    if precision == "fp16":  # what accelerate does on a GPU (see the module docstring)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=20)
        accelerator.native_amp = True
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.01 * s))
    model, optimizer, schedule, loader = accelerator.prepare(
        model, optimizer, schedule, DataLoader(data, batch_size=8)
    )
    handle = watch(
        model,
        optimizer,
        accelerator=accelerator,
        run=case,
        url=live_collector.url,
        layer_stats_every=EVERY,
        flush_interval=0.05,
    )
    inner = optimizer.optimizer
    truth, micro, counters = Truth(), [], []
    for index, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x).float(), y)
            if index in spikes:
                loss = loss * SPIKE
            micro.append(loss.item())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                scaler = accelerator.scaler
                truth.loss_scale.append(None if scaler is None else scaler.get_scale())
                truth.lr.append(inner.param_groups[0]["lr"])
                truth.loss.append(sum(micro) / len(micro))
                micro.clear()
                step = len(truth.lr)
                if (step - 1) % EVERY == 0:
                    truth.zero_fraction[step] = {
                        n: (p.grad == 0).double().mean().item() for n, p in model.named_parameters()
                    }
                if case.endswith("-value"):
                    # before unscaling: a power-of-two scale divides the norm exactly
                    grads = [p.grad for p in model.parameters()]
                    divide = 1.0 if scaler is None else scaler.get_scale()
                    truth.grad_norm.append(torch.nn.utils.get_total_norm(grads).item() / divide)
                    accelerator.clip_grad_value_(model.parameters(), CLIP_VALUE)
                    truth.grad_norm_clipped.append(torch.nn.utils.get_total_norm(grads).item())
                else:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                    truth.grad_norm.append(norm.item())
                state = inner.state.get(inner.param_groups[0]["params"][0], {})
                counters.append(int(state["step"]) if "step" in state else 0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    handle.detach()
    final = int(inner.state[inner.param_groups[0]["params"][0]]["step"])
    truth.skipped = [a == b for b, a in zip(counters, [*counters[1:], final])]
    assert len(truth.skipped) == steps
    if precision == "fp16":
        assert sum(truth.skipped) >= 2, "overflows were not forced"
    if case.endswith("-value"):  # the clip changed the norm: a post-clip read would differ
        finite = [i for i, n in enumerate(truth.grad_norm) if n < float("inf")]
        assert all(truth.grad_norm_clipped[i] < 0.9 * truth.grad_norm[i] for i in finite)
    stored = stored_run(live_collector.url, case)
    assert_matches(stored, truth)
    findings = {e["data"]["code"] for e in stored["events"] if e["kind"] == "finding"}
    assert ("bf16_in_use" in findings) == (precision == "bf16")  # autocast inside forward
