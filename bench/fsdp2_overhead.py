"""The FSDP2 variant of `agent_overhead.py`: the same model sharded with `fully_shard` (each
block, then the root; `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, as
torchtitan does) on 2 gloo CPU processes, AdamW, the loop clipping with
`torch.nn.utils.clip_grad_norm_(1.0)` (whose global norm the agent stores), bare, at
defaults and with every statistic every step.

Modes are interleaved: each round runs a short block per mode in an order shuffled by a
generator seeded alike on both ranks (the ranks must attach and detach together: `watch()`
broadcasts the run id), and rank 0 prints the median over rounds of each mode's median
step time over the bare one, by wall clock and by its process's CPU time. The steps of a
sharded loop wait on collectives, so rank 1's agent work shows in rank 0's wall clock.

    python bench/agent_overhead.py --fsdp2 --sizes 0.1M
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from agent_overhead import (
    CLIP,
    CLIP_NORM,
    CLOCKS,
    MODES,
    SIZES,
    Block,
    _model,
    _quartiles,
    timed_steps,
)
from torch import nn

Loop = tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]


def _setup(size: str, rank: int) -> Loop:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    width, blocks, batch, seq = SIZES[size]
    torch.manual_seed(0)
    model = _model(width, blocks)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in model:
        if isinstance(module, Block):
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(
        0, 256, (8, batch, seq + 1), generator=torch.Generator().manual_seed(rank)
    )
    return model, optimizer, tokens


def _train_step(loop: Loop, step: int) -> None:
    model, optimizer, tokens = loop
    batch = tokens[step % len(tokens)]
    logits = model(batch[:, :-1]).float()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    if CLIP["on"]:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _block(loop: Loop, steps: int, every: int | None) -> dict[str, list[float]]:
    from ampwatch.agent import watch

    model, optimizer, _ = loop
    handle = None
    if every is not None:
        handle = watch(
            model, optimizer, transport=lambda body, headers: 200, layer_stats_every=every
        )
    times = timed_steps(lambda step: _train_step(loop, step), steps)
    if handle is not None:
        handle.detach()
    return times


def _worker(
    rank: int, init_file: str, sizes: list[str], rounds: int, steps: int, clip: bool
) -> None:
    warnings.filterwarnings("ignore")
    CLIP["on"] = clip
    torch.set_num_threads(1)  # two processes on a shared host: one thread each
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for size in sizes:
            loop = _setup(size, rank)
            for step in range(3):  # warm-up
                _train_step(loop, step)
            rng = random.Random(0)  # the same order of modes on both ranks
            ratios: dict[tuple[str, str], list[float]] = {
                (m, c): [] for m in MODES if m != "bare" for c in CLOCKS
            }
            bare: list[float] = []
            for _ in range(rounds):
                order = list(MODES)
                rng.shuffle(order)
                times = {mode: _block(loop, steps, MODES[mode]) for mode in order}
                bare += times["bare"]["wall"]
                for (mode, clock), values in ratios.items():
                    base = statistics.median(times["bare"][clock])
                    values.append(statistics.median(times[mode][clock]) / base)
            if rank == 0:
                params = sum(p.numel() for p in loop[0].parameters())
                print(
                    f"\n{size} FSDP2 (2 gloo ranks, bf16 params, fp32 reduce): "
                    f"{params / 1e6:.2f}M params; bare step median "
                    f"{statistics.median(bare) * 1e3:.2f} ms (rank 0)"
                )
                for (mode, clock), values in ratios.items():
                    q1, q2, q3 = _quartiles(values)
                    print(
                        f"  {mode:9s} {clock:4s} ratio median {q2:.3f}  "
                        f"IQR [{q1:.3f}, {q3:.3f}]  over {len(values)} rounds"
                    )
    finally:
        dist.destroy_process_group()


def fsdp2_variant(sizes: list[str], rounds: int, steps: int) -> None:
    """Spawn the two ranks; rank 0 prints."""
    print(
        f"torch {torch.__version__}, FSDP2 on 2 gloo CPU processes, {rounds} rounds x "
        f"{steps} steps per mode, the loop {'clips' if CLIP['on'] else 'does not clip'}"
    )
    with tempfile.TemporaryDirectory() as folder:
        init = os.path.join(folder, "init")
        mp.spawn(_worker, args=(init, sizes, rounds, steps, CLIP["on"]), nprocs=2, join=True)
