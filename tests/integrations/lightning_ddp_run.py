"""One Lightning DDP fit (`strategy="ddp"`, gloo, 2 CPU processes) with the callback, run as
a script: Lightning's DDP launcher starts rank 1 by running this file again. Each rank
writes the ground truth its own `on_before_optimizer_step` saw to `<out>/rank<r>.json`.

    python tests/integrations/lightning_ddp_run.py URL OUT_DIR
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

import torch
from framework_truth import Truth
from lightning.pytorch import Trainer
from test_lightning import EVERY, TinyNet
from torch.utils.data import DataLoader, TensorDataset

from ampwatch.integrations.lightning import AmpwatchCallback

STEPS = 30


def main(url: str, out: Path) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2 * STEPS * 8, 16), torch.randn(2 * STEPS * 8, 4))
    truth = Truth()
    model = TinyNet(fused=False, spike_batches={3, STEPS - 5}, truth=truth)
    callback = AmpwatchCallback(
        run="lightning-ddp", url=url, layer_stats_every=EVERY, flush_interval=0.05
    )
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", precision="bf16-mixed",
        max_steps=STEPS, callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=8))
    record = dataclasses.asdict(truth)
    record["zero_fraction"] = {str(k): v for k, v in truth.zero_fraction.items()}
    record["skipped"] = [False] * len(truth.lr)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
