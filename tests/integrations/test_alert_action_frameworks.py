"""Alert to action through the frameworks, against a live collector: a NaN loss (a bad
batch, real FP16 math with the framework's own GradScaler) fires `nan_loss`, critical; with
`on_critical="stop"` the Lightning callback saves through `trainer.save_checkpoint` and
sets `trainer.should_stop`, the HF callback sets `control.should_save` and
`control.should_training_stop`; both record the checkpoint for the advisor and report
`EXIT_CRITICAL_ALERT`. A step sleeps 10 ms, as a real step takes time; the runs are given
far more steps than the alert needs."""

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
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers import Trainer as HfTrainer

from ampwatch.agent import EXIT_CRITICAL_ALERT
from ampwatch.integrations.lightning import AmpwatchCallback as LightningCallback
from ampwatch.integrations.transformers import AmpwatchCallback as HfCallback

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]
BAD_BATCH = 5
MAX_STEPS = 400


def _checkpoints(url: str) -> list[dict[str, Any]]:
    runs = httpx.get(f"{url}/api/v1/runs").json()["runs"]
    answer = httpx.get(f"{url}/api/v1/runs/{runs[0]['id']}/checkpoints").json()
    return list(answer["checkpoints"])


class BadBatchNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y)
        time.sleep(0.01)
        return loss * math.nan if index == BAD_BATCH else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_lightning_stops_after_saving_through_the_trainer(live_collector, tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(MAX_STEPS * 8, 16), torch.randn(MAX_STEPS * 8, 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    callback = LightningCallback(
        run="lightning-stop", url=live_collector.url, flush_interval=0.05, on_critical="stop"
    )
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=MAX_STEPS, callbacks=[callback], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    trainer.fit(BadBatchNet(), DataLoader(data, batch_size=8))
    assert BAD_BATCH < trainer.global_step < MAX_STEPS
    assert callback.exit_code == EXIT_CRITICAL_ALERT
    saved = tmp_path / f"ampwatch-critical-step={trainer.global_step}.ckpt"
    assert saved.is_file()
    assert [(c["step"], c["path"]) for c in _checkpoints(live_collector.url)] == [
        (trainer.global_step, str(saved))
    ]


def test_hf_trainer_saves_and_stops(live_collector, tmp_path: Path) -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    )
    calls = iter(range(1_000_000))

    def bad_batch(module: nn.Module, args: Any, output: Any) -> Any:
        if torch.is_grad_enabled():
            time.sleep(0.01)
            if next(calls) == BAD_BATCH:
                output.loss = output.loss * math.nan
        return output

    model.register_forward_hook(bad_batch)
    tokens = torch.randint(0, 64, (MAX_STEPS * 2, 16))
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=MAX_STEPS,
        learning_rate=1e-3, report_to=[], save_strategy="no", fp16=True, use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    callback = HfCallback(
        run="hf-stop", url=live_collector.url, flush_interval=0.05, on_critical="stop"
    )
    data = [{"input_ids": t, "labels": t} for t in tokens]
    trainer = HfTrainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer.accelerator.native_amp = True  # what accelerate does on a GPU
    trainer.train()
    step = trainer.state.global_step
    assert BAD_BATCH < step < MAX_STEPS
    assert callback.exit_code == EXIT_CRITICAL_ALERT
    saved = tmp_path / f"checkpoint-{step}"
    assert (saved / "model.safetensors").is_file()
    assert [(c["step"], c["path"]) for c in _checkpoints(live_collector.url)] == [
        (step, str(saved))
    ]
