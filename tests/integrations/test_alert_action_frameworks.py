"""Alert to action through the frameworks, against a live collector, end to end: a NaN loss
(a poisoned sample, real FP16 math with the framework's own GradScaler) fires `nan_loss`,
critical; with `on_critical="stop"` the Lightning callback saves through
`trainer.save_checkpoint` and sets `trainer.should_stop`, the HF callback sets
`control.should_save` and `control.should_training_stop`; both report the trainer's
checkpoints to the advisor and `EXIT_CRITICAL_ALERT`. Then the resume plan names the
periodic checkpoint before the onset and the data to skip, and the relaunch loads it
through the framework's own resume path (`ckpt_path`, `resume_from_checkpoint`) with
`resume_from=plan`, skips that data, and trains on past the old stop with no new alert.
A step sleeps 10 ms, as a real step takes time; the runs are given far more steps than the
alert needs."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import torch
import torch.nn.functional as F
from accelerate.state import AcceleratorState
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers import Trainer as HfTrainer

from ampwatch.agent import EXIT_CRITICAL_ALERT, ResumeFrom, load_resume_plan
from ampwatch.integrations.lightning import AmpwatchCallback as LightningCallback
from ampwatch.integrations.transformers import AmpwatchCallback as HfCallback

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]
#: The batch holding the poisoned sample (its step is POISON + 1); checkpoints every 4 steps.
POISON = 13
SAVE_EVERY = 4
#: The plan's margin before the onset (the default, 20 steps, needs a longer run).
MARGIN = 2
MAX_STEPS = 400
#: Steps the relaunch trains past the old stop.
PAST = 10


class Api:
    """The collector's read API for the one run of a test."""

    def __init__(self, url: str) -> None:
        (run,) = httpx.get(f"{url}/api/v1/runs").json()["runs"]  # a relaunch continues it
        self.run = f"{url}/api/v1/runs/{run['id']}"

    def get(self, path: str, **params: Any) -> Any:
        answer = httpx.get(f"{self.run}{path}", params=params, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def checkpoints(self) -> list[tuple[int, str]]:
        return [(c["step"], c["path"]) for c in self.get("/checkpoints")["checkpoints"]]


def _check_plan(plan: dict[str, Any], path: str, *, batches: list[int] | None) -> None:
    """The plan after the stop: the last periodic checkpoint before the onset (the poisoned
    step), and from the step after it to MARGIN steps past the onset to skip."""
    checkpoint = POISON // SAVE_EVERY * SAVE_EVERY
    assert plan["ready"] and (plan["onset_step"], plan["onset_rule"]) == (POISON + 1, "nan_loss")
    assert (plan["checkpoint"]["step"], plan["checkpoint"]["path"]) == (checkpoint, path)
    skip = plan["skip"]
    assert (skip["start"], skip["end"]) == (checkpoint + 1, POISON + 1 + MARGIN)
    assert skip["skip_batches"] == batches


def _check_resumed(
    api: Api, plan: ResumeFrom, stopped: int, trained: list[int], skipped: list[int]
) -> None:
    """The relaunch trained the data after the skipped batches, past the old stop, with no
    new critical alert, under the same run: its resume recorded, the abandoned tail kept
    apart. `skipped`: the steps that stepped no optimizer."""
    assert plan.skip_steps is not None
    last = plan.skip_steps[1]
    assert trained[0] == last and POISON not in trained  # batch `last` is step last + 1's
    alerts = api.get("/alerts")["alerts"]
    assert [a["fired_step"] for a in alerts if a["severity"] == "critical"] == [POISON + 1]
    assert all(a["status"] == "resolved" for a in alerts if a["severity"] == "critical")
    events = api.get("/events")["events"]
    assert [e["step"] for e in events if e["kind"] == "resumed"] == [plan.step]
    (tail,) = api.get("/abandoned-steps")["tails"]
    assert tail["from_step"] == plan.step and tail["step"][-1] == stopped
    steps = api.get("/steps", max_points=100_000)
    assert steps["step"] == list(range(1, stopped + PAST + 1))
    assert all(isinstance(v, float) for v in steps["loss"][plan.step :] if v is not None)
    pairs = zip(steps["step"], steps["skipped"], strict=True)
    assert [s for s, was in pairs if was and s > plan.step] == skipped


class ResumableLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader Lightning resumes mid-epoch (the `state_dict` / `load_state_dict`
    interface it saves in the checkpoint): it restarts after the last batch consumed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0
        self._skip = 0

    def __iter__(self) -> Any:
        skip, self._skip = self._skip, 0
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.consumed = index + 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["consumed"]


class PoisonedNet(LightningModule):
    """A sample of batch POISON makes the loss NaN; with a plan, its batches are skipped
    (`training_step` returns None: Lightning steps no optimizer)."""

    def __init__(self, plan: ResumeFrom | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.plan = plan
        self.trained: list[int] = []

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor | None:
        x, y, ids = batch
        if self.plan is not None and self.plan.skips(index, self.current_epoch):
            return None
        self.trained.append(int(ids[0]) // 8)  # the data's own batch number
        loss = F.mse_loss(self.net(x).float(), y)
        time.sleep(0.01)
        return loss * math.nan if bool((ids == POISON * 8).any()) else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _lightning_fit(
    url: str, folder: Path, *, max_steps: int, plan: ResumeFrom | None = None
) -> tuple[Trainer, LightningCallback, PoisonedNet]:
    torch.manual_seed(0)
    count = MAX_STEPS * 8
    data = TensorDataset(torch.randn(count, 16), torch.randn(count, 4), torch.arange(count))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    callback = LightningCallback(
        run="lightning-stop", url=url, flush_interval=0.05, on_critical="stop", resume_from=plan
    )
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=SAVE_EVERY, save_top_k=-1)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[callback, saves],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(folder), plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    model = PoisonedNet(plan)
    trainer.fit(model, ResumableLoader(data, batch_size=8), ckpt_path=plan and plan.path)
    return trainer, callback, model


def test_lightning_stops_then_resumes_from_the_plan(live_collector, tmp_path: Path) -> None:
    trainer, callback, _ = _lightning_fit(live_collector.url, tmp_path, max_steps=MAX_STEPS)
    stopped = trainer.global_step
    assert POISON < stopped < MAX_STEPS
    assert callback.exit_code == EXIT_CRITICAL_ALERT
    saved = tmp_path / f"ampwatch-critical-step={stopped}.ckpt"
    assert saved.is_file()
    api = Api(live_collector.url)
    periodic = [(s, str(tmp_path / f"epoch=0-step={s}.ckpt")) for s in range(4, stopped + 1, 4)]
    assert sorted(api.checkpoints()) == sorted([*periodic, (stopped, str(saved))])

    plan = api.get("/resume-plan", margin_steps=MARGIN)
    _check_plan(plan, str(tmp_path / "epoch=0-step=12.ckpt"), batches=[12, 13, 14, 15])
    resume = load_resume_plan(plan)
    trainer, callback, model = _lightning_fit(
        live_collector.url, tmp_path, max_steps=stopped + PAST, plan=resume
    )
    assert trainer.global_step == stopped + PAST and callback.exit_code == 0
    _check_resumed(api, resume, stopped, model.trained, skipped=[13, 14, 15, 16])


def _hf_train(
    url: str, folder: Path, *, max_steps: int, plan: ResumeFrom | None = None
) -> tuple[HfTrainer, HfCallback, list[int]]:
    """GPT-2 (tiny) in FP16 through the HF Trainer, one batch of 2 samples a step, in order
    (`train_sampling_strategy="sequential"`); sample POISON * 2 carries token 63 first,
    which makes the loss NaN. With a plan: the samples of its skipped steps are left out of
    the data (batch s - 1 is step s's), and the Trainer resumes from its checkpoint."""
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    )
    trained: list[int] = []

    def poisoned(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if torch.is_grad_enabled():
            time.sleep(0.01)
            tokens = kwargs["input_ids"]
            trained.append(int(tokens[0, 1]) * 64 + int(tokens[0, 2]))  # its sample number
            if bool((tokens[:, 0] == 63).any()):
                output.loss = output.loss * math.nan
        return output

    model.register_forward_hook(poisoned, with_kwargs=True)
    tokens = torch.randint(0, 63, (MAX_STEPS * 2, 16))
    numbers = torch.arange(MAX_STEPS * 2)
    tokens[:, 1], tokens[:, 2] = numbers // 64, numbers % 64
    tokens[POISON * 2, 0] = 63
    data = [{"input_ids": t, "labels": t} for t in tokens]
    if plan is not None and plan.skip_steps is not None:
        first, last = plan.skip_steps
        data = data[: (first - 1) * 2] + data[last * 2 :]
    args = TrainingArguments(
        output_dir=str(folder), per_device_train_batch_size=2, max_steps=max_steps,
        learning_rate=1e-3, report_to=[], save_strategy="steps", save_steps=SAVE_EVERY,
        fp16=True, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        train_sampling_strategy="sequential",
    )  # fmt: skip
    callback = HfCallback(
        run="hf-stop", url=url, flush_interval=0.05, on_critical="stop", resume_from=plan
    )
    trainer = HfTrainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer.accelerator.native_amp = True  # what accelerate does on a GPU
    trainer.train(resume_from_checkpoint=plan and plan.path)
    return trainer, callback, [number // 2 for number in trained]  # as batch numbers


def test_hf_trainer_saves_stops_then_resumes_from_the_plan(live_collector, tmp_path: Path) -> None:
    trainer, callback, _ = _hf_train(live_collector.url, tmp_path, max_steps=MAX_STEPS)
    stopped = trainer.state.global_step
    assert POISON < stopped < MAX_STEPS
    assert callback.exit_code == EXIT_CRITICAL_ALERT
    saved = tmp_path / f"checkpoint-{stopped}"
    assert (saved / "model.safetensors").is_file()
    api = Api(live_collector.url)
    # A stop at a periodic step saves once: the Trainer's own save, asked for twice.
    periodic = [(s, str(tmp_path / f"checkpoint-{s}")) for s in range(4, stopped, 4)]
    assert api.checkpoints() == [*periodic, (stopped, str(saved))]

    plan = api.get("/resume-plan", margin_steps=MARGIN)
    _check_plan(plan, str(tmp_path / "checkpoint-12"), batches=None)  # no data position
    resume = load_resume_plan(plan)
    trainer, callback, trained = _hf_train(
        live_collector.url, tmp_path, max_steps=stopped + PAST, plan=resume
    )
    assert trainer.state.global_step == stopped + PAST and callback.exit_code == 0
    _check_resumed(api, resume, stopped, trained, skipped=[])  # the data left out instead
