"""The Hugging Face Trainer (transformers 5.x) on the CPU against a live collector: a
2-layer GPT-2 built from a config (nothing downloaded), compared step by step with the
Trainer's own ground truth: its logged `grad_norm` (before clipping) and the norm of the
gradients its clip left (stored as `grad_norm_clipped`), the lr and scale in
effect at `on_pre_optimizer_step`, the sum of what `training_step` returned (what it logs
as `loss`, before rounding), and the optimizer's step counter (it does not move on a skip).

bf16 is the Trainer's own CPU path (accelerate enters autocast inside the model's forward).
On the CPU accelerate builds no GradScaler for `fp16=True` (`native_amp` is False there):
the FP16 cases set `trainer.accelerator.scaler = GradScaler("cpu")` and `native_amp =
True` before `train()` creates the optimizer, which is what accelerate does on a GPU.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")

import torch
from accelerate.state import AcceleratorState
from framework_truth import Truth, assert_matches, stored_run
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ampwatch.integrations.transformers import AmpwatchCallback

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
EVERY = 7
SPIKE = 1e6

CASES = {
    # name: (precision, fused, accumulation, optimizer steps)
    "hf-bf16-unfused-acc1": ("bf16", False, 1, 100),
    "hf-bf16-fused-acc4": ("bf16", True, 4, 30),
    "hf-fp16-scaler-unfused-acc4": ("fp16", False, 4, 20),
    "hf-fp16-scaler-fused-acc1": ("fp16", True, 1, 60),
}


class Recording(Trainer):
    """Records what `training_step` returns (the Trainer's logged loss is their sum)."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.micro_losses = [*getattr(self, "micro_losses", []), loss.item()]
        return loss


class Truths(TrainerCallback):
    def __init__(self, trainer: Recording, truth: Truth) -> None:
        self.trainer, self.truth, self.counters = trainer, truth, []

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        inner = optimizer.optimizer
        self.truth.loss.append(sum(self.trainer.micro_losses))
        self.trainer.micro_losses = []
        scaler = optimizer.scaler
        self.truth.loss_scale.append(None if scaler is None else scaler.get_scale())
        self.truth.lr.append(inner.param_groups[0]["lr"])
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.truth.grad_norm_clipped.append(torch.nn.utils.get_total_norm(grads).item())
        step = len(self.truth.lr)
        if (step - 1) % EVERY == 0:
            self.truth.zero_fraction[step] = {
                n: (p.grad == 0).double().mean().item()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        state_of = inner.state.get(inner.param_groups[0]["params"][0], {})
        self.counters.append(int(state_of["step"]) if "step" in state_of else 0)


@pytest.mark.parametrize("case", list(CASES))
def test_hf_trainer_is_stored_exactly(case: str, live_collector, tmp_path) -> None:
    precision, fused, accumulation, steps = CASES[case]
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)
    spikes, calls = {3, 40, 41, steps * accumulation - 5}, iter(range(1_000_000))

    def spike(module, args, output):  # the model's own loss spikes on chosen micro-batches
        if torch.is_grad_enabled() and next(calls) in spikes:
            output.loss = output.loss * SPIKE
        return output

    model.register_forward_hook(spike)
    tokens = torch.randint(0, 64, (steps * accumulation * 4, 16))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=True,
        max_grad_norm=1.0,
        disable_tqdm=True,
        optim="adamw_torch_fused" if fused else "adamw_torch",
        dataloader_num_workers=0,
    )
    callback = AmpwatchCallback(
        run=case, url=live_collector.url, layer_stats_every=EVERY, flush_interval=0.05
    )
    trainer = Recording(model=model, args=args, train_dataset=data, callbacks=[callback])
    if precision == "fp16":  # what accelerate does on a GPU (see the module docstring)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        trainer.accelerator.native_amp = True
    truth = Truth()
    recorder = Truths(trainer, truth)
    trainer.add_callback(recorder)
    trainer.train()
    AcceleratorState._reset_state(reset_partial_state=True)

    logs = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(logs) == steps
    truth.grad_norm = [entry["grad_norm"] for entry in logs]  # the Trainer's own, pre-clip
    if precision == "bf16":  # under FP16 the spikes overflow instead
        assert max(truth.grad_norm) > 10 * 1.0  # the spikes, though clipped to 1.0
    # HF clips to max_grad_norm=1.0: after its clip the norm is min(logged, 1.0); on an
    # overflowing FP16 step the clip by an Inf norm leaves NaN gradients (the step skips).
    for logged, after in zip(truth.grad_norm, truth.grad_norm_clipped, strict=True):
        if math.isfinite(logged):
            assert after == pytest.approx(min(logged, 1.0), rel=1e-5)
        else:
            assert math.isnan(after)
    inner = trainer.optimizer.optimizer
    final = int(inner.state[inner.param_groups[0]["params"][0]]["step"])
    counters = [*recorder.counters[1:], final]
    truth.skipped = [a == b for b, a in zip(recorder.counters, counters)]
    assert len(truth.skipped) == steps
    if precision == "fp16":
        assert sum(truth.skipped) >= 2, "overflows were not forced"
    else:
        assert not any(truth.skipped)
    stored = stored_run(live_collector.url, case)
    assert_matches(stored, truth)
    findings = {e["data"]["code"] for e in stored["events"] if e["kind"] == "finding"}
    # autocast entered inside the model's forward
    assert ("bf16_in_use" in findings) == (precision == "bf16")
    assert "clip_before_unscale" not in findings
