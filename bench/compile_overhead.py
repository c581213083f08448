"""The agent under `torch.compile`: graphs compiled and step time, with and without
`watch()`, with gradient accumulation.

A transformer-style model (an embedding, pre-norm blocks, a final LayerNorm, a head),
FP16 autocast + GradScaler("cpu") + AdamW, M micro-batches per optimizer step. Graphs are
counted by a backend that wraps the chosen one (dynamo calls it once per graph, each
recompile included). Step time is the median over the steps after the first two (which
compile); the agent runs at its defaults and with every statistic every step.

    python bench/compile_overhead.py                       # aot_eager, 4 and 8 micro-batches
    python bench/compile_overhead.py --backend inductor    # needs a C++ compiler
    python bench/compile_overhead.py --quick               # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch._dynamo
from torch import nn

from ampwatch.agent import watch


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, width: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(blocks)))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(self.blocks(self.embed(tokens))))


def run(backend: str, micro: int, steps: int, every: int | None) -> tuple[int, float, float]:
    """(graphs compiled, median step seconds after the first two, the first step's seconds:
    mostly compiling) for one configuration; `every` None: no agent."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    graphs = [0]
    inner = torch._dynamo.lookup_backend(backend)

    def counting(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        graphs[0] += 1
        return inner(graph, inputs)

    model = Model(256, 128, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    compiled = torch.compile(model, backend=counting)
    handle = None
    if every is not None:
        handle = watch(
            compiled, optimizer, scaler, transport=lambda body, headers: 200,
            layer_stats_every=every,
        )  # fmt: skip
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        for _ in range(micro):
            tokens = torch.randint(0, 256, (4, 32))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(compiled(tokens).float().flatten(0, 1),
                                                   tokens.flatten())  # fmt: skip
            scaler.scale(loss / micro).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    if handle is not None:
        handle.detach()
    return graphs[0], statistics.median(times[2:]), times[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro", type=int, nargs="+", default=[4, 8], help="micro-batches")
    parser.add_argument("--quick", action="store_true", help="3 steps, 4 micro-batches")
    args = parser.parse_args()
    steps, micros = (3, [4]) if args.quick else (args.steps, args.micro)
    print(f"backend={args.backend} steps={steps} (median of steps 3..{steps})")
    print(f"{'micro':>5} {'agent':>10} {'graphs':>6} {'step ms':>8} {'ratio':>6} {'first s':>8}")
    for micro in micros:
        bare = None
        for label, every in (("none", None), ("defaults", 50), ("every step", 1)):
            graphs, seconds, first = run(args.backend, micro, steps, every)
            bare = seconds if bare is None else bare
            print(
                f"{micro:>5} {label:>10} {graphs:>6} {seconds * 1e3:>8.1f} {seconds / bare:>6.3f}"
                f" {first:>8.1f}",
                flush=True,  # an inductor run cut short still shows what it measured
            )


if __name__ == "__main__":
    main()
