"""Lightning 2.6 on the CPU against a live collector, compared step by step with
Lightning's own ground truth: its optimizer's step counter (it does not move on a skip),
its scaler's scale, the lr and gradients its `on_before_optimizer_step` sees (after
unscale_, before clipping), the gradients its clip left, and what `training_step` returned.

FP16 runs use a `MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))` plugin:
`Trainer(precision="16-mixed")` on the CPU turns into bf16 without a scaler, which the
bf16 cases cover. Overflows are forced by multiplying chosen batches' loss by 1e6.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("lightning")

import torch
import torch.nn.functional as F
from framework_truth import Truth, assert_matches, stored_run
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ampwatch.integrations.lightning import AmpwatchCallback

pytestmark = [
    # Lightning warns about CPU-only runs and loader workers; none concern what is tested.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),  # lightning vs torch 2.13
]

EVERY = 7
SPIKE = 1e6


class TinyNet(LightningModule):
    """A 3-layer MLP whose hooks record Lightning's ground truth for each optimizer step."""

    def __init__(self, *, fused: bool, spike_batches: set[int], truth: Truth) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.fused = fused
        self.spike_batches = spike_batches
        self.truth = truth
        self.micro_losses: list[float] = []
        self.counters: list[int] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.head(self.body(x)).float(), y)  # a submodule, not forward()
        if index in self.spike_batches:
            loss = loss * SPIKE
        self.micro_losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        truth = self.truth
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        scale = None if scaler is None else scaler.get_scale()
        truth.loss_scale.append(scale)
        truth.lr.append(optimizer.param_groups[0]["lr"])
        truth.loss.append(sum(self.micro_losses) / len(self.micro_losses))
        self.micro_losses.clear()
        grads = {n: p.grad for n, p in self.named_parameters() if p.grad is not None}
        norm = torch.nn.utils.get_total_norm(list(grads.values())).item()
        if scaler is not None and self.fused:
            norm /= scale  # fused AdamW unscales inside its kernel: these are still scaled
        truth.grad_norm.append(norm)
        step = len(truth.lr)
        if (step - 1) % EVERY == 0:
            truth.zero_fraction[step] = {
                n: (g == 0).double().mean().item() for n, g in grads.items()
            }
        state = optimizer.state.get(self.head.weight, {})
        self.counters.append(int(state["step"]) if "step" in state else 0)

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if gradient_clip_val:  # the norm of what Lightning's clip left
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.truth.grad_norm_clipped.append(torch.nn.utils.get_total_norm(grads).item())

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.01 * s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


CASES = {
    # name: (precision, fused, accumulation, clip, optimizer steps)
    "fp16-scaler-unfused-acc1-clip": ("fp16", False, 1, 0.5, 200),
    "fp16-scaler-fused-acc4": ("fp16", True, 4, 0.0, 75),
    "bf16-unfused-acc4-clip": ("bf16", False, 4, 0.5, 75),
    "bf16-fused-acc1": ("bf16", True, 1, 0.0, 200),
    # gradient_clip_algorithm="value": the stored norm is the one before the clip
    "fp16-scaler-unfused-acc1-clipvalue": ("fp16", False, 1, 0.01, 60),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lightning_fit_is_stored_exactly(case: str, live_collector) -> None:
    precision, fused, accumulation, clip, steps = CASES[case]
    torch.manual_seed(0)
    batches = steps * accumulation
    data = TensorDataset(torch.randn(batches * 8, 16), torch.randn(batches * 8, 4))
    # Overflows (FP16) or loss spikes (bf16) in early, clustered and late micro-batches.
    spikes = {b for b in (3, 40, 41, 42, batches - 5) if b < batches}
    truth = Truth()
    model = TinyNet(fused=fused, spike_batches=spikes, truth=truth)
    if precision == "fp16":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=20)
        extra = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    else:
        extra = {"precision": "bf16-mixed"}
    callback = AmpwatchCallback(
        run=case, url=live_collector.url, layer_stats_every=EVERY, flush_interval=0.05
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulation,
        gradient_clip_val=clip or None,
        gradient_clip_algorithm="value" if case.endswith("clipvalue") else "norm",
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **extra,
    )
    trainer.fit(model, DataLoader(data, batch_size=8))
    assert callback.handle is None  # detached at on_train_end

    # The optimizer's own step counter does not move on a skipped step.
    final = int(trainer.optimizers[0].state[model.head.weight]["step"])
    counters = [*model.counters[1:], final]
    truth.skipped = [after == before for before, after in zip(model.counters, counters)]
    assert trainer.global_step == steps == len(truth.skipped)
    if precision == "fp16":
        assert sum(truth.skipped) >= 2, "overflows were not forced"
    else:
        assert not any(truth.skipped)

    if case.endswith("clipvalue"):  # the clip changed the norm: a post-clip read would differ
        finite = [i for i, n in enumerate(truth.grad_norm) if n < float("inf")]
        assert all(truth.grad_norm_clipped[i] < 0.9 * truth.grad_norm[i] for i in finite)
    stored = stored_run(live_collector.url, case)
    assert stored["run"]["status"] == "ended"
    assert len(truth.grad_norm_clipped) == (steps if clip else 0)
    assert_matches(stored, truth)  # with the post-clip norm where the loop clipped
    if not clip:
        assert stored["steps"]["grad_norm_clipped"] == [None] * steps
    findings = {e["data"]["code"] for e in stored["events"] if e["kind"] == "finding"}
    # Lightning enters autocast around training_step, which calls submodules only.
    assert ("bf16_in_use" in findings) == (precision == "bf16")


def test_the_lightning_overhead_bench_runs_a_quick_round() -> None:
    bench = Path(__file__).parents[2] / "bench" / "agent_overhead.py"
    result = subprocess.run(
        [sys.executable, str(bench), "--lightning", "--quick", "--sizes", "0.1M"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "callback/plain  wall ratio median" in result.stdout
    assert "isolated: on_before_backward" in result.stdout


def _trainer(callback: AmpwatchCallback, steps: int, **kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[callback, *kwargs.pop("extra", [])],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _loader(batches: int) -> DataLoader:
    torch.manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randn(batches * 8, 16), torch.randn(batches * 8, 4)), batch_size=8
    )


def test_a_resumed_fit_continues_the_run_and_a_failing_one_ends_it_failed(
    live_collector, tmp_path
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def callback() -> AmpwatchCallback:
        return AmpwatchCallback(run="resumed", run_id="resumed-1", url=live_collector.url)

    first = TinyNet(fused=False, spike_batches=set(), truth=Truth())
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _trainer(callback(), 30, extra=[saver]).fit(first, _loader(40))
    resumed = TinyNet(fused=False, spike_batches=set(), truth=Truth())
    _trainer(callback(), 50, enable_checkpointing=False).fit(
        resumed, _loader(40), ckpt_path=str(tmp_path / "last.ckpt")
    )
    stored = stored_run(live_collector.url, "resumed")
    assert stored["steps"]["step"] == list(range(1, 51))  # numbering continues at 31
    ends = [e["data"]["status"] for e in stored["events"] if e["kind"] == "run_end"]
    assert ends == ["finished", "finished"]

    class Failing(TinyNet):
        def training_step(self, batch, index):
            if index == 12:
                raise RuntimeError("diverged")
            return super().training_step(batch, index)

    failing = Failing(fused=False, spike_batches=set(), truth=Truth())
    with pytest.raises(RuntimeError, match="diverged"):
        _trainer(
            AmpwatchCallback(run="failing", url=live_collector.url), 30, enable_checkpointing=False
        ).fit(failing, _loader(40))
    stored = stored_run(live_collector.url, "failing")
    assert stored["steps"]["step"] == list(range(1, 13))
    (end,) = [e for e in stored["events"] if e["kind"] == "run_end"]
    assert end["data"]["status"] == "failed" and "diverged" in end["data"]["reason"]


def test_a_lightning_optimizer_is_unwrapped_to_the_one_it_steps() -> None:
    """`self.optimizers()` in a LightningModule is a LightningOptimizer, which takes on its
    optimizer's class without being it: watch() hooks the optimizer inside."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from ampwatch.agent import watch

    model = nn.Linear(4, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = watch(model, LightningOptimizer(inner), transport=lambda body, headers: 200)
    assert inner._optimizer_step_pre_hooks and inner._optimizer_step_post_hooks
    model(torch.randn(3, 4)).sum().backward()
    inner.step()
    assert handle.step == 1
    handle.detach()
    assert not inner._optimizer_step_pre_hooks


class TwoOptimizers(LightningModule):
    """A GAN-shaped manual-optimization `training_step` (Lightning's own GAN example: the
    discriminator steps first, each optimizer zeroes its gradients after its step); the
    truth is read just before the discriminator's step, the first optimizer's."""

    def __init__(self, spike_batches: set[int], truth: Truth) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.disc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.spike_batches, self.truth = spike_batches, truth
        self.counters: list[int] = []
        self.lr_groups: list[list[float]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        opt_d, opt_g = self.optimizers()
        real, noise = batch[0], batch[1][:, :4].repeat(1, 2)
        fake = self.gen(noise)
        loss_d = (
            F.softplus(-self.disc(real)).mean() + F.softplus(self.disc(fake.detach())).mean()
        ).float()
        if index in self.spike_batches:
            loss_d = loss_d * SPIKE
        self.manual_backward(loss_d)
        truth, inner = self.truth, opt_d.optimizer
        truth.loss.append(loss_d.item())
        truth.loss_scale.append(None)
        truth.lr.append(inner.param_groups[0]["lr"])
        self.lr_groups.append([inner.param_groups[0]["lr"], opt_g.optimizer.param_groups[0]["lr"]])
        grads = {n: p.grad for n, p in self.named_parameters() if p.grad is not None}
        assert all(n.startswith("disc.") for n in grads)  # the generator's were zeroed
        truth.grad_norm.append(torch.nn.utils.get_total_norm(list(grads.values())).item())
        step = len(truth.lr)
        if (step - 1) % EVERY == 0:
            truth.zero_fraction[step] = {
                n: (g == 0).double().mean().item() for n, g in grads.items()
            }
        state = inner.state.get(self.disc[2].weight, {})
        self.counters.append(int(state["step"]) if "step" in state else 0)
        opt_d.step()
        opt_d.zero_grad()
        loss_g = F.softplus(-self.disc(fake)).mean().float()
        self.manual_backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()

    def configure_optimizers(self) -> list:
        return [
            torch.optim.AdamW(self.disc.parameters(), lr=2e-4),
            torch.optim.AdamW(self.gen.parameters(), lr=1e-3),
        ]


def test_several_optimizers_record_the_first_ones_step(live_collector) -> None:
    """Manual optimization with two optimizers (bf16): one record per batch, at the first
    optimizer's step, with its lr, every optimizer's lr in `lr_groups`, the loss of the
    batch's first backward and the gradients present when it steps; Lightning's own
    `global_step` counts both optimizers' steps."""
    torch.manual_seed(0)
    batches = 60
    spikes = {3, 40, batches - 5}
    truth = Truth()
    model = TwoOptimizers(spikes, truth)
    callback = AmpwatchCallback(
        run="two-optimizers", url=live_collector.url, layer_stats_every=EVERY, flush_interval=0.05
    )
    # max_steps counts Lightning's global_step: every optimizer's steps, 2 per batch here
    _trainer(
        callback, 2 * batches, precision="bf16-mixed", enable_checkpointing=False, max_epochs=1
    ).fit(model, _loader(batches))
    assert model.trainer.global_step == 2 * batches
    final = int(model.optimizers()[0].optimizer.state[model.disc[2].weight]["step"])
    counters = [*model.counters[1:], final]
    truth.skipped = [after == before for before, after in zip(model.counters, counters)]
    assert not any(truth.skipped) and len(truth.skipped) == batches

    stored = stored_run(live_collector.url, "two-optimizers")
    assert stored["run"]["status"] == "ended"
    assert_matches(stored, truth)
    assert stored["steps"]["lr_groups"] == model.lr_groups
    # The gradient statistics are the first optimizer's (the run's layer list also names
    # the generator's Linear weights: their FP8 readiness records).
    layers = stored["layers"]
    with_gradients = {name for i, name in enumerate(layers["layers"])
                      if any(row[i] is not None for row in layers["values"])}  # fmt: skip
    assert with_gradients == {n for n, _ in model.disc.named_parameters(prefix="disc")}


def test_ddp_rank0_sends_the_steps_and_every_rank_its_layer_statistics(
    live_collector, tmp_path
) -> None:
    """`strategy="ddp"` on 2 CPU processes (gloo), one run: rank 0's records are its own
    ground truth step by step; rank 1 sends no step records, only its layer statistics,
    which match what its own hook saw (DDP's all-reduced gradients)."""
    script = Path(__file__).with_name("lightning_ddp_run.py")
    subprocess.run(
        [sys.executable, str(script), live_collector.url, str(tmp_path)],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    truths = {}
    for rank in (0, 1):
        raw = json.loads((tmp_path / f"rank{rank}.json").read_text())
        raw["zero_fraction"] = {int(k): v for k, v in raw["zero_fraction"].items()}
        truths[rank] = Truth(**raw)
    assert len(truths[0].lr) == len(truths[1].lr) == 30

    stored = stored_run(live_collector.url, "lightning-ddp")  # one run for both ranks
    assert stored["run"]["status"] == "ended"
    assert_matches(stored, truths[0])
    with httpx.Client(base_url=f"{live_collector.url}/api/v1/runs/{stored['run']['id']}") as api:
        assert api.get("/steps", params={"rank": 1}).json()["step"] == []
        layers = api.get("/layers", params={"stat": "zero_fraction", "rank": 1}).json()
    assert layers["steps"] == sorted(truths[1].zero_fraction) == [1, 8, 15, 22, 29]
    for step, row in zip(layers["steps"], layers["values"], strict=True):
        expected = [truths[1].zero_fraction[step][name] for name in layers["layers"]]
        assert row == pytest.approx(expected, abs=1e-12)


class SometimesNone(TinyNet):
    """`training_step` returns None on chosen batches: Lightning then runs no backward and,
    with a scaler, neither `scaler.step` nor `scaler.update()`, yet `global_step` moves."""

    none_batches = frozenset({10, 11, 30})

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], index: int
    ) -> torch.Tensor | None:
        loss = super().training_step(batch, index)
        if index in self.none_batches:
            self.micro_losses.pop()
            return None
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        returned_none = not self.micro_losses
        self.micro_losses = self.micro_losses or [0.0]
        super().on_before_optimizer_step(optimizer)
        if returned_none:  # nothing measured: no loss, no gradients
            self.truth.loss[-1] = self.truth.grad_norm[-1] = None


def test_a_step_returning_none_keeps_lightnings_numbering(live_collector) -> None:
    """FP16 with a scaler: the batches whose `training_step` returned None are recorded at
    Lightning's own step number, skipped, with the scale and lr in effect; every later step
    keeps Lightning's numbering (the scaler tap alone would have fallen behind by 3)."""
    torch.manual_seed(0)
    steps = 40
    truth = Truth()
    model = SometimesNone(fused=False, spike_batches={3}, truth=truth)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=20)
    callback = AmpwatchCallback(
        run="returns-none", url=live_collector.url, layer_stats_every=EVERY, flush_interval=0.05
    )
    _trainer(
        callback,
        steps,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        enable_checkpointing=False,
    ).fit(model, _loader(steps))
    final = int(model.trainer.optimizers[0].state[model.head.weight]["step"])
    counters = [*model.counters[1:], final]
    truth.skipped = [after == before for before, after in zip(model.counters, counters)]
    assert model.trainer.global_step == steps == len(truth.skipped)
    assert [i for i, s in enumerate(truth.skipped) if s] == [3, 10, 11, 30]  # overflow, Nones

    stored = stored_run(live_collector.url, "returns-none")
    assert_matches(stored, truth)
