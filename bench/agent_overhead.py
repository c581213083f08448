"""Agent overhead: step time of the standard torch.amp loop with and without `watch()`.

DESIGN's bar is <= 3% at defaults on CPU. Blocks with and without the agent alternate, so
drift on a noisy machine hits both; the median step time of each is compared. The
transport is a no-op that accepts every batch: this measures the agent, not the network.

    python bench/agent_overhead.py [--steps 200] [--blocks 5] [--width 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from ampwatch.agent import watch


def _model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.LayerNorm(width), nn.Linear(width, 64))


def _block(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    data: torch.Tensor,
    steps: int,
    agent: bool,
) -> list[float]:
    handle = watch(model, optimizer, scaler, transport=lambda body, headers: 200) if agent else None
    times = []
    for step in range(steps):
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(data[step % len(data)]).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    if handle is not None:
        handle.detach()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = _model(args.width, args.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.randn(8, args.batch, args.width)
    _block(model, optimizer, scaler, data, 20, agent=False)  # warm-up
    plain: list[float] = []
    watched: list[float] = []
    for _ in range(args.blocks):
        plain += _block(model, optimizer, scaler, data, args.steps, agent=False)
        watched += _block(model, optimizer, scaler, data, args.steps, agent=True)
    base, with_agent = statistics.median(plain), statistics.median(watched)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M params, {len(list(model.parameters()))} tensors")
    print(f"median step without agent: {base * 1e3:.3f} ms")
    print(f"median step with agent:    {with_agent * 1e3:.3f} ms")
    print(f"overhead: {100 * (with_agent - base) / base:+.2f}% (bar: <= 3% on CPU)")


if __name__ == "__main__":
    main()
