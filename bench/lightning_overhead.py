"""The Lightning variant of `agent_overhead.py`: the same model and FP16 loop run by a
Lightning `Trainer` (a `MixedPrecision("16-mixed", "cpu", GradScaler)` plugin, clipping
at 1.0), bare, with the plain agent (`watch()` attached at `on_train_start`), and with
`AmpwatchCallback`. The callback's only per-step work beyond the plain agent is
`on_before_backward` (the loss, unscaled, logged): the ratio callback / plain agent and
that hook's isolated cost show whether it adds anything measurable.

    python bench/agent_overhead.py --lightning --sizes 0.1M
"""

from __future__ import annotations

import random
import statistics
import time
import warnings
from typing import Any

import torch
from agent_overhead import CLIP, CLIP_NORM, SIZES, _model, _quartiles
from torch import nn

MODES = ("bare", "plain agent", "callback")


def lightning_variant(
    sizes: list[str], rounds: int, steps: int, calls: int, rng: random.Random
) -> None:
    warnings.filterwarnings("ignore")  # Lightning's CPU and loader-worker hints
    import logging

    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.plugins.precision import MixedPrecision

    from ampwatch.agent import watch
    from ampwatch.integrations.lightning import AmpwatchCallback

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Net(LightningModule):
        def __init__(self, size: str) -> None:
            super().__init__()
            width, blocks, batch, seq = SIZES[size]
            torch.manual_seed(0)
            self.net = _model(width, blocks)
            self.tokens = torch.randint(0, 256, (8, batch, seq + 1))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            tokens = self.tokens[index % len(self.tokens)]
            logits = self.net(tokens[:, :-1]).float()
            return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timer(Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self._started)

    class PlainAgent(Callback):  # type: ignore[misc]
        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.handle = watch(
                module,
                trainer.optimizers,
                trainer.precision_plugin.scaler,
                transport=lambda body, headers: 200,
            )

        def on_train_end(self, trainer: Any, module: Any) -> None:
            self.handle.detach()

    def fit(module: Net, mode: str) -> list[float]:
        timer = Timer()
        callbacks: list[Any] = [timer]
        if mode == "plain agent":
            callbacks.append(PlainAgent())
        elif mode == "callback":
            callbacks.append(AmpwatchCallback(transport=lambda body, headers: 200))
        scaler = torch.amp.GradScaler("cpu")
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps + 1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            gradient_clip_val=CLIP_NORM if CLIP["on"] else None,
            callbacks=callbacks,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        )
        trainer.fit(module, [0] * (steps + 1))
        return timer.times[1:]  # the first step holds attach-time work

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, Lightning variant, "
        f"{rounds} rounds x {steps} steps per mode"
    )
    for size in sizes:
        module = Net(size)
        fit(module, "bare")  # warm-up
        ratios: dict[str, list[float]] = {"plain agent": [], "callback": [], "callback/plain": []}
        for _ in range(rounds):
            order = list(MODES)
            rng.shuffle(order)
            medians = {mode: statistics.median(fit(module, mode)) for mode in order}
            ratios["plain agent"].append(medians["plain agent"] / medians["bare"])
            ratios["callback"].append(medians["callback"] / medians["bare"])
            ratios["callback/plain"].append(medians["callback"] / medians["plain agent"])
        print(f"\n{size}: bare Lightning step median {medians['bare'] * 1e3:.2f} ms (last round)")
        for name, values in ratios.items():
            q1, q2, q3 = _quartiles(values)
            print(f"  {name:15s} wall ratio median {q2:.3f}  IQR [{q1:.3f}, {q3:.3f}]")
        # The callback's own per-step work: on_before_backward on a scaled loss.
        callback = AmpwatchCallback(transport=lambda body, headers: 200)
        callback.handle = watch(nn.Linear(2, 2), transport=lambda body, headers: 200)
        callback._scaler = torch.amp.GradScaler("cpu")
        callback._scaler.scale(torch.ones(()))  # the scale exists, as after scale(loss)
        loss = torch.tensor(2.5, requires_grad=True) * 1.0
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            callback.on_before_backward(None, None, loss)
            times.append(time.perf_counter() - started)
        callback.handle.detach()
        cost = statistics.median(times)
        print(
            f"  isolated: on_before_backward {cost * 1e6:.1f} us per micro-batch "
            f"({100 * cost / medians['bare']:.3f}% of the bare step)"
        )
