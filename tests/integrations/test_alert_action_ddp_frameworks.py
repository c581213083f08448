"""Alert to action under DDP through the frameworks: 2 gloo CPU ranks, a Lightning fit and
then an HF Trainer run in the same spawn, each with a bad batch (a NaN loss on both ranks,
real FP16 math with the framework's GradScaler) that fires `nan_loss`, critical, on a live
collector. Whichever rank hears it first, the callbacks agree (Lightning's
`reduce_boolean_decision`, a `torch.distributed` MAX for the HF Trainer) at an
`AGREE_EVERY` step: both ranks stop at the same step, the checkpoint is saved once and
reported once, and both report `EXIT_CRITICAL_ALERT`."""

from __future__ import annotations

import json
import math
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ampwatch.agent import EXIT_CRITICAL_ALERT
from ampwatch.agent.policy import AGREE_EVERY

BAD_BATCH = 5
MAX_STEPS = 300
#: A hang (one rank stopping alone) fails the test rather than blocking the suite.
SPAWN_TIMEOUT_S = 300


class BadBatchNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y)
        time.sleep(0.01)  # a real step takes time
        return loss * math.nan if index == BAD_BATCH else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _lightning(url: str, folder: Path) -> dict[str, Any]:
    from ampwatch.integrations.lightning import AmpwatchCallback

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(MAX_STEPS * 16, 16), torch.randn(MAX_STEPS * 16, 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    callback = AmpwatchCallback(
        run="lightning-ddp-stop", url=url, flush_interval=0.05, on_critical="stop"
    )
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=MAX_STEPS, callbacks=[callback],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(folder),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    trainer.fit(BadBatchNet(), DataLoader(data, batch_size=8))
    return {"step": trainer.global_step, "exit_code": callback.exit_code}


def _hf(url: str, folder: Path) -> dict[str, Any]:
    from accelerate.state import AcceleratorState
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from ampwatch.integrations.transformers import AmpwatchCallback

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
    tokens = torch.randint(0, 64, (MAX_STEPS * 4, 16))
    args = TrainingArguments(
        output_dir=str(folder), per_device_train_batch_size=2, max_steps=MAX_STEPS,
        learning_rate=1e-3, report_to=[], save_strategy="no", fp16=True, use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, ddp_backend="gloo",
    )  # fmt: skip
    callback = AmpwatchCallback(run="hf-ddp-stop", url=url, flush_interval=0.05, on_critical="stop")
    data = [{"input_ids": t, "labels": t} for t in tokens]
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer.accelerator.native_amp = True  # what accelerate does on a GPU
    trainer.train()
    return {"step": trainer.state.global_step, "exit_code": callback.exit_code}


def _worker(rank: int, port: int, url: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
    )  # fmt: skip
    os.environ.pop("AMPWATCH_RUN_ID", None)
    warnings.simplefilter("ignore")
    results = {
        "lightning": _lightning(url, Path(out, "lightning")),
        "hf": _hf(url, Path(out, "hf")),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _checkpoints(url: str, name: str) -> list[tuple[int, str]]:
    runs = httpx.get(f"{url}/api/v1/runs").json()["runs"]
    (run,) = [r for r in runs if r["name"] == name]
    answer = httpx.get(f"{url}/api/v1/runs/{run['id']}/checkpoints").json()
    return [(c["step"], c["path"]) for c in answer["checkpoints"]]


def test_lightning_and_hf_stop_every_rank_at_the_same_step(live_collector, tmp_path: Path) -> None:
    context = mp.spawn(
        _worker, args=(_free_port(), live_collector.url, str(tmp_path)), nprocs=2, join=False
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("a rank did not finish: it waits for one that stopped alone")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    print(f"\nstops: {ranks}")
    for framework in ("lightning", "hf"):
        steps = {ranks[r][framework]["step"] for r in (0, 1)}
        assert len(steps) == 1, (framework, ranks)  # every rank at the same step
        step = steps.pop()
        assert BAD_BATCH < step < MAX_STEPS and step % AGREE_EVERY == 0, framework
        assert [ranks[r][framework]["exit_code"] for r in (0, 1)] == [EXIT_CRITICAL_ALERT] * 2
    step = ranks[0]["lightning"]["step"]
    saved = tmp_path / "lightning" / f"ampwatch-critical-step={step}.ckpt"
    assert [p.name for p in (tmp_path / "lightning").glob("*.ckpt")] == [saved.name]
    assert _checkpoints(live_collector.url, "lightning-ddp-stop") == [(step, str(saved))]
    step = ranks[0]["hf"]["step"]
    saved = tmp_path / "hf" / f"checkpoint-{step}"
    assert (saved / "model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "hf").glob("checkpoint-*")] == [saved.name]
    assert _checkpoints(live_collector.url, "hf-ddp-stop") == [(step, str(saved))]
