"""A synthetic OPT-175B-style divergence, as wire batches, for the dashboard's browser tests.

`STEPS` optimizer steps of one run, loss scale 2^16 with a few isolated overflow skips
(the scale halves, then doubles back after `GROWTH_INTERVAL` clean steps). From `SPIKE_STEP` the
final-layer activation norm climbs far above its baseline; from `COLLAPSE_STEP` every step
overflows for `COLLAPSE_SKIPS` steps, so the scale halves down to 2^-5 (below 1.0: the
collapse alert fires), and the loss turns NaN now and then. Checkpoints every 1,000 steps
and at 5,500: the advisor should recommend the last one well before the spike.
Per-layer statistics every `LAYER_EVERY` steps for `LAYERS`, with exponent histograms;
`FROZEN` stops learning at `FROZEN_FROM` (zero fraction 1.0), and `DRIFTING`'s gradients
shrink step by step toward FP16's flush-to-zero range at the scale in effect.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from ampwatch.agent.wire import EXPONENT_BIAS, WIRE_VERSION, encode_float

STEPS = 6000
STEPS_PER_BATCH = 1000
LAYER_EVERY = 20
SPIKE_STEP = 4600
COLLAPSE_STEP = 4700
COLLAPSE_SKIPS = 21
GROWTH_INTERVAL = 2000
CHECKPOINTS = (1000, 2000, 3000, 4000, 5000, 5500)
ISOLATED_SKIPS = frozenset({1500, 2500, 3500})
LAYERS = [
    "embed.weight",
    "blocks.0.attn.qkv.weight",
    "blocks.0.mlp.fc1.weight",
    "blocks.1.attn.qkv.weight",
    "blocks.1.mlp.fc1.weight",
    "blocks.2.mlp.fc2.weight",
    "head.weight",
]
FROZEN = "blocks.1.mlp.fc1.weight"
FROZEN_FROM = 5200
DRIFTING = "blocks.2.mlp.fc2.weight"
CLIENT_RUN_ID = "divergence"
RUN_NAME = "gpt-fp16-divergence"
ELEMENTS = 4096


def skipped(step: int) -> bool:
    return step in ISOLATED_SKIPS or COLLAPSE_STEP <= step < COLLAPSE_STEP + COLLAPSE_SKIPS


def scales() -> list[float]:
    """The scale in effect at each step 1..STEPS (index step - 1), as GradScaler moves it:
    halve after a skipped step, double after `GROWTH_INTERVAL` clean steps."""
    scale, clean, out = 65536.0, 0, []
    for step in range(1, STEPS + 1):
        out.append(scale)
        if skipped(step):
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == GROWTH_INTERVAL and step < COLLAPSE_STEP:
                scale, clean = scale * 2, 0
    return out


def histogram(center_log2: float) -> tuple[int, list[int]]:
    """A bell of ELEMENTS float32 exponents around |g| = 2^center_log2: (offset, counts)."""
    field = round(center_log2) + EXPONENT_BIAS
    weights = [math.exp(-0.5 * (d / 2.5) ** 2) for d in range(-8, 9)]
    total = sum(weights)
    counts = [round(ELEMENTS * w / total) for w in weights]
    return field - 8, counts


def layer_center(name: str, step: int) -> float:
    """log2 of a layer's typical |gradient| at a step."""
    if name == DRIFTING:
        return -20.0 - 14.0 * step / STEPS  # from 2^-20 down to 2^-34
    return -18.0 - (LAYERS.index(name) % 3)


def layer_record(step: int, scale: float) -> dict[str, Any]:
    k = math.log2(scale)
    zero, subnormal, flush, peak, offsets, counts = [], [], [], [], [], []
    for name in LAYERS:
        frozen = name == FROZEN and step >= FROZEN_FROM
        offset, hist = (0, [ELEMENTS]) if frozen else histogram(layer_center(name, step))
        offsets.append(offset)
        counts.append(hist)
        fields = [(offset + j, c) for j, c in enumerate(hist)]
        scaled = [(f - EXPONENT_BIAS + k, c) for f, c in fields if f > 0]
        zero.append(1.0 if frozen else 0.001)
        flush.append(sum(c for e, c in scaled if e < -24) / ELEMENTS)
        subnormal.append(sum(c for e, c in scaled if -24 <= e < -14) / ELEMENTS)
        peak.append(0.0 if frozen else 2.0 ** (max(e for e, _ in scaled) + 1))
    return {
        "step": step,
        "rank": 0,
        "names": LAYERS,
        "stats": {
            "zero_fraction": zero,
            "subnormal_fraction": subnormal,
            "flush_fraction": flush,
            "max_abs_scaled": peak,
        },
        "exponent_histograms": {"offsets": offsets, "counts": counts},
    }


def step_record(step: int, scale: float) -> dict[str, Any]:
    diverging = step >= SPIKE_STEP
    act_max = 12.0 + 0.3 * math.sin(step / 7.0)
    if diverging:
        act_max += 0.5 * (step - SPIKE_STEP)
    loss = 3.0 * math.exp(-step / 3000) + 1.0 + 0.02 * math.sin(step / 3.0)
    if step >= COLLAPSE_STEP:
        loss += 0.002 * (step - COLLAPSE_STEP)
    nan_loss = step >= COLLAPSE_STEP and step % 97 == 0
    return {
        "step": step,
        "rank": 0,
        "skipped": skipped(step),
        "loss": "NaN" if nan_loss else encode_float(loss),
        "loss_scale": scale,
        "grad_norm": encode_float(math.inf) if skipped(step) else 0.8 + 0.1 * math.cos(step / 50),
        "lr": 3e-4,
        "act_norm_mean": act_max * 0.6,
        "act_norm_max": act_max,
    }


def batches(
    *,
    steps: int = STEPS,
    t0: float = 1.75e9,
    client_run_id: str = CLIENT_RUN_ID,
    name: str = RUN_NAME,
) -> Iterator[dict[str, Any]]:
    """The run's first `steps` steps as wire batches of `STEPS_PER_BATCH` steps, in order
    (fewer steps: a healthy run, stopped before anything goes wrong)."""
    in_effect = scales()
    for seq, first in enumerate(range(1, steps + 1, STEPS_PER_BATCH)):
        last = min(first + STEPS_PER_BATCH - 1, steps)
        span = range(first, last + 1)
        events: list[dict[str, Any]] = [
            {"kind": "checkpoint", "step": s, "time": t0 + s, "data": {"path": f"/ckpt/{s}.pt"}}
            for s in CHECKPOINTS
            if s in span
        ]
        if first == 1:
            events.insert(0, {"kind": "run_start", "step": None, "time": t0, "data": {}})
        yield {
            "wire_version": WIRE_VERSION,
            "run": {"client_run_id": client_run_id, "name": name, "project": "default"},
            "stream": "0",
            "seq": seq,
            "steps": [step_record(s, in_effect[s - 1]) for s in span],
            "layer_stats": [
                layer_record(s, in_effect[s - 1]) for s in span if s % LAYER_EVERY == 0
            ],
            "events": events,
            "dropped": {"steps": 0, "layer_stats": 0, "events": 0},
        }
