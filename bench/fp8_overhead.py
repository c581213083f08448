"""FP8 readiness overhead: one sample's isolated cost per tensor size, and the step-time
ratio at the default interval (`ampwatch.agent.fp8.DEFAULT_EVERY`).

Same loop and models as `bench/agent_overhead.py` (FP16 autocast + GradScaler + AdamW on a
transformer-style model). Three modes run in blocks of M steps (so every block holds
exactly one FP8 sample at its first step), in a shuffled order per round: `bare`, `agent`
(watch() with FP8 off) and `defaults` (watch() with its defaults, FP8 every M steps).
Printed: the median over rounds of each mode's block time / bare, and `defaults / agent`
(what the FP8 statistics add). Isolated: the median time of `quantisation_counts` (all 8
format x scaling combinations of one tensor) per tensor size, and of one whole sample of
each model (weights and gradients; activations are measured in the forward of that step).

    python bench/fp8_overhead.py --threads 1        # ~5 minutes on 2 loaded cores
    python bench/fp8_overhead.py --quick            # smoke run
    python bench/fp8_overhead.py --device cuda
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from agent_overhead import SIZES, _setup, _train_step

from ampwatch.agent import watch
from ampwatch.agent.fp8 import DEFAULT_EVERY, Fp8Monitor, quantisation_counts

TENSOR_SIZES = ((256, 256), (1024, 256), (1024, 1024), (4096, 1024), (4096, 4096))
MODES = ("bare", "agent", "defaults")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_seconds(fn: object, calls: int, device: str) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def isolated_per_tensor(device: str, calls: int, sizes: tuple[tuple[int, int], ...]) -> None:
    for rows, cols in sizes:
        x = torch.randn(rows, cols, device=device)
        quantisation_counts(x)
        seconds = _median_seconds(lambda x=x: quantisation_counts(x), calls, device)
        print(
            f"  one tensor {rows}x{cols} ({rows * cols / 1e6:.2f}M values): "
            f"{seconds * 1e3:.2f} ms  ({seconds / (rows * cols) * 1e9:.1f} ns/value)"
        )


def _block(
    loop: tuple, steps: int, mode: str, device: str, every: int = DEFAULT_EVERY
) -> tuple[float, float]:
    """(wall, process CPU) seconds of `steps` steps; the watched block's step 1 samples.
    CPU time counts every thread of this process (the sender's too, which flushes every
    second inside the block) and nothing of the other processes on a shared host. Attach
    and detach are outside the timing, as in agent_overhead.py (once per run)."""
    model, optimizer, scaler, _ = loop
    handle = None
    if mode != "bare":
        handle = watch(
            model,
            optimizer,
            scaler,
            transport=lambda body, headers: 200,
            fp8_stats_every=every if mode == "defaults" else None,
        )
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        _train_step(loop, step)
    _sync(device)
    times = time.perf_counter() - wall, time.process_time() - cpu
    if handle is not None:
        handle.detach()
    return times


def sampled_step_extra(loop: tuple, pairs: int, steps: int, device: str) -> dict[str, float]:
    """Median extra seconds per step of sampling FP8 every step (activations included)
    over the agent without FP8, from interleaved pairs of short blocks."""
    extra: dict[str, list[float]] = {"wall": [], "cpu": []}
    rng = random.Random(1)
    for _ in range(pairs):
        order = ["defaults", "agent"]
        rng.shuffle(order)
        got = {mode: _block(loop, steps, mode, device, every=1) for mode in order}
        for i, clock in enumerate(("wall", "cpu")):
            extra[clock].append((got["defaults"][i] - got["agent"][i]) / steps)
    return {clock: statistics.median(values) for clock, values in extra.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of M-step blocks")
    parser.add_argument("--pairs", type=int, default=8, help="pairs for the sampled-step cost")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--quick", action="store_true", help="1 round of 10-step blocks")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = 10 if args.quick else DEFAULT_EVERY
    rounds = 1 if args.quick else args.rounds
    print(
        f"torch {torch.__version__} on {args.device}, {torch.get_num_threads()} threads; "
        f"M = {DEFAULT_EVERY}; {rounds} rounds of {steps}-step blocks per mode"
    )
    isolated_per_tensor(
        args.device,
        2 if args.quick else args.calls,
        TENSOR_SIZES[:2] if args.quick else TENSOR_SIZES,
    )
    rng = random.Random(0)
    for size in args.sizes:
        loop = _setup(size, args.device)
        model = loop[0]
        for step in range(3):
            _train_step(loop, step)
        monitor = Fp8Monitor(
            model, activations=False, on_error=print, to_host=lambda t: (t.to("cpu"), None)
        )
        _train_step(loop, 0)
        linears = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
        sample = _median_seconds(lambda m=monitor: m._sample(1), args.calls, args.device)
        extra = sampled_step_extra(loop, 2 if args.quick else args.pairs, 3, args.device)
        blocks: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for _ in range(rounds):
            order = list(MODES)
            rng.shuffle(order)
            for mode in order:
                blocks[mode].append(_block(loop, steps, mode, args.device))
        bare = {c: statistics.median(b[i] for b in blocks["bare"]) / steps
                for i, c in enumerate(("wall", "cpu"))}  # fmt: skip
        print(
            f"\n{size}: {linears} Linear layers; bare step {bare['wall'] * 1e3:.2f} ms "
            f"(CPU {bare['cpu'] * 1e3:.2f} ms); one sample of weights + gradients "
            f"{sample * 1e3:.1f} ms = {sample / bare['wall']:.2f} steps"
        )
        for clock in ("wall", "cpu"):
            derived = 1 + extra[clock] / (DEFAULT_EVERY * bare[clock])
            print(
                f"  {clock}: a sampled step costs {extra[clock] * 1e3:.1f} ms more "
                f"(activations included) = {extra[clock] / bare[clock]:.2f} steps; at "
                f"M = {DEFAULT_EVERY}: step-time ratio {derived:.4f} (derived)"
            )
        for i, clock in enumerate(("wall", "cpu")):
            for mode in ("agent", "defaults"):
                ratios = [b[i] / a[i] for b, a in zip(blocks[mode], blocks["bare"], strict=True)]
                print(
                    f"  {clock} {mode:8s} / bare median {statistics.median(ratios):.3f}  "
                    f"rounds {[round(r, 3) for r in ratios]}"
                )
            added = [d[i] / a[i] for d, a in zip(blocks["defaults"], blocks["agent"], strict=True)]
            print(
                f"  {clock} defaults / agent median {statistics.median(added):.3f} "
                "(what FP8 adds, measured)"
            )


if __name__ == "__main__":
    main()
