"""`ampwatch demo`: real FP16 training on the CPU that shows what ampwatch is for.

Three short runs of one small transformer-style language model, each with the agent
attached, each a failure mode (or its absence) that a user should recognise on the
dashboard:

1. ``demo-healthy``: autocast FP16 with a `GradScaler`; the scale calibrates, then grows.
2. ``demo-silent-underflow``: the same model with the scaler disabled and the loss divided
   by a large global token count. No NaN, no crash, a normal-looking loss, while whole
   layers get exactly-zero gradients in FP16 and stop learning.
3. ``demo-divergence``: a learning rate that keeps climbing. The final-layer activation
   norm rises first, then every step overflows, each skip halves the scale, and the scale
   collapses toward zero: the OPT-175B signature. Checkpoints are saved along the way.

Torch is imported here only, so the collector itself never needs it.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

VOCAB = 256
#: Dividing the loss by this (a global batch's token count) pushes the block weights'
#: FP16 gradients below 2^-24 (measured: LayerNorm and fc1 grads all exactly zero).
UNDERFLOW_DIVISOR = 2.0**14


@dataclass(frozen=True)
class Phase:
    """One demo run: its name, length and what makes it go right or wrong."""

    name: str
    steps: int
    scaler_enabled: bool
    loss_divisor: float = 1.0
    lr_growth: float = 1.0  # per-step factor on the learning rate
    checkpoint_every: int = 0


def phases(steps: int) -> list[Phase]:
    """The demo's runs; `steps` is the length of the healthy one."""
    return [
        Phase("demo-healthy", steps, scaler_enabled=True, checkpoint_every=max(steps // 4, 1)),
        Phase("demo-silent-underflow", steps, scaler_enabled=False, loss_divisor=UNDERFLOW_DIVISOR),
        # 1.08 per step: the scale grows while the loss falls, then overflows take over
        # around step 110 and the scale halves every step from there.
        Phase(
            "demo-divergence",
            max(steps, 200),
            scaler_enabled=True,
            lr_growth=1.08,
            checkpoint_every=20,
        ),
    ]


def tiny_lm(seed: int, vocab_in: int = VOCAB) -> torch.nn.Module:
    """The demo's model (also the scenario suite's): embedding of `vocab_in` tokens,
    pre-norm residual MLP blocks, final norm, an output head over `VOCAB`."""
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self, d: int = 32, depth: int = 4) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab_in, d)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                for _ in range(depth)
            )
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            hidden = self.emb(tokens)
            for block in self.blocks:
                hidden = hidden + block(hidden)
            logits: torch.Tensor = self.head(self.norm(hidden))
            return logits

    torch.manual_seed(seed)
    return TinyLM()


def synthetic_batches(
    seed: int, vocab_in: int = VOCAB, batch: int = 16, seq: int = 16
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable synthetic task: predict (7·token + 3) mod VOCAB from tokens < `vocab_in`."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab_in, (batch, seq), generator=generator)
        yield tokens, (tokens * 7 + 3) % VOCAB


def train_phase(
    phase: Phase,
    *,
    url: str,
    checkpoint_dir: Path,
    seed: int = 0,
    on_step: Callable[[Phase, int, float], None] | None = None,
) -> str:
    """Train one phase with the agent attached; return the run's client id."""
    import torch
    from torch import nn

    from ampwatch.agent import watch

    torch.set_num_threads(min(torch.get_num_threads(), 2))
    model = tiny_lm(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=2.0**16, growth_interval=50, enabled=phase.scaler_enabled
    )
    loss_fn = nn.CrossEntropyLoss()
    data = synthetic_batches(seed)
    with watch(model, optimizer, scaler, run=phase.name, project="demo", url=url) as handle:
        for step in range(1, phase.steps + 1):
            tokens, targets = next(data)
            for group in optimizer.param_groups:
                group["lr"] = 1e-3 * phase.lr_growth ** (step - 1)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(tokens)
            loss = loss_fn(logits.float().view(-1, VOCAB), targets.view(-1))
            if not phase.scaler_enabled:
                handle.log_loss(loss.detach())
            scaler.scale(loss / phase.loss_divisor).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if phase.checkpoint_every and step % phase.checkpoint_every == 0:
                path = checkpoint_dir / f"{phase.name}-step{step}.pt"
                torch.save(
                    {"model": model.state_dict(), "scaler": scaler.state_dict(), "step": step}, path
                )
                handle.checkpoint(str(path), step=step)
            if on_step is not None:
                on_step(phase, step, loss.item())
        return handle.client_run_id


def run_demo(
    url: str, *, steps: int = 300, checkpoint_dir: Path | None = None, quiet: bool = False
) -> list[str]:
    """Train every phase against the collector at `url`; return the runs' client ids."""
    directory = checkpoint_dir or Path(tempfile.mkdtemp(prefix="ampwatch-demo-"))

    def report(phase: Phase, step: int, loss: float) -> None:
        if not quiet and (step % 50 == 0 or step == phase.steps):
            shown = f"{loss:.4f}" if math.isfinite(loss) else str(loss)
            print(f"  {phase.name}: step {step}/{phase.steps}  loss {shown}", flush=True)

    return [
        train_phase(phase, url=url, checkpoint_dir=directory, on_step=report)
        for phase in phases(steps)
    ]
