"""Agent overhead: step time of the torch.amp loop with and without `watch()`.

Bars (DESIGN, issue 3): median ratio <= 1.03 at defaults and <= 1.15 with every statistic
(exponent histograms included) every step, on the CPU. A transformer-style model in two
sizes (~0.1M and ~3M parameters), `torch.autocast("cpu", float16)` + GradScaler("cpu") +
AdamW. Each round runs a short block of steps per mode (bare, defaults, all-stats) in a
shuffled order, so drift on a noisy machine hits every mode; per round, each mode's median
step time is divided by the bare median, and the script prints the median ratio over
rounds with its interquartile range, by wall clock and by the process's CPU time (all its
threads, the sender's included; other processes on a shared host do not inflate it). It
also times the agent's per-step work alone (the scaler tap's `before_update` on real
gradients, many calls) as a share of the bare step: the cost without the noise, and the
way the 1-in-N sampled step enters the defaults figure. The transport accepts every batch
in memory: this measures the agent, not the network.

    python bench/agent_overhead.py --threads 1   # full run, ~6 minutes on 2 loaded cores
    python bench/agent_overhead.py --quick       # smoke run: 1 round, few steps
    python bench/agent_overhead.py --device cuda # on a GPU (bar there: <= 1.01)
    python bench/agent_overhead.py --lightning   # the Lightning callback vs the plain agent
    python bench/agent_overhead.py --fsdp2 --sizes 0.1M  # FSDP2, 2 gloo processes

The loop clips in the canonical order (`unscale_`, `clip_grad_norm_(1.0)`, `step`), as
most training loops do, and the agent stores the norm that clip returned instead of a
second pass over every gradient; `--no-clip` measures a loop that does not clip (the
agent then computes the norm itself).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from ampwatch.agent import clipping, watch
from ampwatch.agent.config import DEFAULT_LAYER_STATS_EVERY

#: width, blocks, batch, sequence length. FP16 matmuls on a CPU are slow (no native FP16
#: GEMM on most x86): the 3M model gets few tokens per step so the run stays in minutes;
#: fewer tokens make the agent's share (which scales with parameters) larger, not smaller.
SIZES = {"0.1M": (64, 2, 8, 32), "3M": (256, 4, 2, 16)}
MODES = {"bare": None, "defaults": DEFAULT_LAYER_STATS_EVERY, "all-stats": 1}
CLOCKS = ("wall", "cpu")


class Block(nn.Module):
    """Pre-norm transformer block: self-attention and a 4x MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, num_heads=4, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def _model(width: int, blocks: int, vocab: int = 256) -> nn.Module:
    return nn.Sequential(
        nn.Embedding(vocab, width),
        *[Block(width) for _ in range(blocks)],
        nn.LayerNorm(width),
        nn.Linear(width, vocab),
    )


Loop = tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler, torch.Tensor]
#: Whether `_train_step` clips (the canonical loop does; `--no-clip` turns it off).
CLIP = {"on": True}
CLIP_NORM = 1.0


def _setup(size: str, device: str = "cpu") -> Loop:
    width, blocks, batch, seq = SIZES[size]
    torch.manual_seed(0)
    model = _model(width, blocks).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device)
    tokens = torch.randint(0, 256, (8, batch, seq + 1), device=device)
    return model, optimizer, scaler, tokens


def _train_step(loop: Loop, step: int) -> None:
    model, optimizer, scaler, tokens = loop
    batch = tokens[step % len(tokens)]
    with torch.autocast(tokens.device.type, dtype=torch.float16):
        logits = model(batch[:, :-1]).float()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    scaler.scale(loss).backward()
    if CLIP["on"]:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)  # looked up per call
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if tokens.is_cuda:  # time the step, not its launch (both modes pay this the same)
        torch.cuda.synchronize()


def _block(loop: Loop, steps: int, every: int | None) -> dict[str, list[float]]:
    """Per-step seconds of `steps` steps after a first untimed one, watched with
    N=`every` (None: bare). Blocks are shorter than N, so "defaults" times the unsampled
    step; its 1-in-N sampled step enters through the isolated cost (printed with it). Two
    clocks: "wall" (what training feels) and "cpu" (this process's CPU time, all threads,
    the sender's included: what the agent costs, blind to other processes on the host)."""
    model, optimizer, scaler, _ = loop
    handle = None
    if every is not None:
        handle = watch(
            model, optimizer, scaler, transport=lambda body, headers: 200, layer_stats_every=every
        )
    times = timed_steps(lambda step: _train_step(loop, step), steps)
    if handle is not None:
        handle.detach()
    return times


def timed_steps(train_step: Callable[[int], None], steps: int) -> dict[str, list[float]]:
    """Seconds of steps 1..`steps` by both clocks, after an untimed step 0 (in every mode:
    attach-time work and the sampled step 1)."""
    times: dict[str, list[float]] = {"wall": [], "cpu": []}
    train_step(0)
    for step in range(1, steps + 1):
        wall, cpu = time.perf_counter(), time.process_time()
        train_step(step)
        times["wall"].append(time.perf_counter() - wall)
        times["cpu"].append(time.process_time() - cpu)
    return times


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _isolated(loop: Loop, calls: int) -> dict[str, float]:
    """Median seconds of the agent's per-step work alone, on real unscaled gradients: the
    scaler tap's `before_update` (scale, found-inf, grad norm, stacking, the host copy),
    on a step without and with the sampled range statistics. When the loop clips, each
    call clips first (by a norm no gradient reaches, so they stay as they are) through the
    agent's wrapper, and the clip alone, timed the same way, is subtracted: what remains
    is the agent's (its wrapper, and the range statistics it takes before the clip)."""
    model, optimizer, scaler, tokens = loop
    handle = watch(model, optimizer, scaler, transport=lambda body, headers: 200)
    batch = tokens[0]
    with torch.autocast(tokens.device.type, dtype=torch.float16):
        logits = model(batch[:, :-1]).float()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # as scaler.step() would: unscaled grads, found-inf flags
    before_update: Callable[[], object] = handle._before_update

    params = list(model.parameters())
    unwrapped_clip = clipping._originals["clip_grad_norm_"]  # the clip, without the wrapper

    def median_time(step: int | None) -> float:
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            if step is None:
                unwrapped_clip(params, 1e30)
            else:
                handle._step = step
                if CLIP["on"]:
                    torch.nn.utils.clip_grad_norm_(params, 1e30)
                before_update()
            if tokens.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    clip = median_time(None) if CLIP["on"] else 0.0
    # step 2 unsampled, step 1 sampled
    result = {"step": median_time(1) - clip, "sampled": median_time(0) - clip}
    handle.detach()
    optimizer.zero_grad(set_to_none=True)
    scaler.update()  # end the half-done iteration
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--steps", type=int, default=5, help="steps per block and mode")
    parser.add_argument("--calls", type=int, default=100, help="isolated-cost calls")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 3 steps")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bar there: <= 1.01)")
    parser.add_argument("--no-clip", action="store_true", help="a loop that does not clip")
    parser.add_argument(
        "--lightning", action="store_true", help="the Lightning callback vs the plain agent"
    )
    parser.add_argument(
        "--fsdp2", action="store_true", help="the model under FSDP2 on 2 gloo CPU processes"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default: torch's); 1 steadies a loaded shared host, "
        "where one descheduled worker thread stalls every parallel op",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds, args.steps, args.calls = 1, 3, 3
    CLIP["on"] = not args.no_clip
    if args.lightning:
        from lightning_overhead import lightning_variant

        lightning_variant(args.sizes, args.rounds, args.steps, args.calls, random.Random(0))
        return
    if args.fsdp2:
        from fsdp2_overhead import fsdp2_variant

        fsdp2_variant(args.sizes, args.rounds, args.steps)
        return

    rng = random.Random(0)
    print(
        f"torch {torch.__version__} on {args.device}, {torch.get_num_threads()} threads, "
        f"N default = "
        f"{DEFAULT_LAYER_STATS_EVERY}, {args.rounds} rounds x {args.steps} steps per mode, "
        f"the loop {'clips' if CLIP['on'] else 'does not clip'}"
    )
    for size in args.sizes:
        loop = _setup(size, args.device)
        params = sum(p.numel() for p in loop[0].parameters())
        tensors = len(list(loop[0].parameters()))
        for step in range(5):  # warm-up
            _train_step(loop, step)
        ratios: dict[tuple[str, str], list[float]] = {
            (m, c): [] for m in MODES if m != "bare" for c in CLOCKS
        }
        pooled: dict[tuple[str, str], list[float]] = {(m, c): [] for m in MODES for c in CLOCKS}
        for _ in range(args.rounds):
            order = list(MODES)
            rng.shuffle(order)
            times = {mode: _block(loop, args.steps, MODES[mode]) for mode in order}
            for (mode, clock), values in pooled.items():
                values += times[mode][clock]
            for (mode, clock), values in ratios.items():
                bare_median = statistics.median(times["bare"][clock])
                values.append(statistics.median(times[mode][clock]) / bare_median)
        bare = statistics.median(pooled["bare", "wall"])
        iso = _isolated(loop, args.calls)
        every = DEFAULT_LAYER_STATS_EVERY
        print(
            f"\n{size}: {params / 1e6:.2f}M params in {tensors} tensors; "
            f"bare step median {bare * 1e3:.2f} ms"
        )
        for (mode, clock), values in ratios.items():
            q1, q2, q3 = _quartiles(values)
            whole = statistics.median(pooled[mode, clock]) / statistics.median(
                pooled["bare", clock]
            )
            bar = 1.03 if mode == "defaults" else 1.15
            print(
                f"  {mode:9s} {clock:4s} ratio median {q2:.3f}  IQR [{q1:.3f}, {q3:.3f}]  "
                f"(pooled steps: {whole:.3f}; bar <= {bar})"
            )
        print(
            f"  isolated: per-step work {iso['step'] * 1e3:.3f} ms, sampled step "
            f"{iso['sampled'] * 1e3:.3f} ms"
        )
        print(
            f"  isolated share of the bare step: defaults "
            f"{100 * (iso['step'] + (iso['sampled'] - iso['step']) / every) / bare:.2f}%, "
            f"all-stats {100 * iso['sampled'] / bare:.2f}%"
        )


if __name__ == "__main__":
    main()
