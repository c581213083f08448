"""Samples (what the training thread hands over) and the wire records built from them.

The training thread only launches device reductions and copies; the sender thread calls
`step_record` / `layer_record`, which wait for the copy (a CUDA event) and do the host-side
arithmetic, so no statistic costs a host sync where it is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ampwatch.agent import wire
from ampwatch.agent.stats import zero_fractions


@dataclass(slots=True)
class StepSample:
    """One optimizer step: `values` (CPU, maybe still being copied) aligned with `fields`."""

    step: int
    rank: int
    fields: tuple[str, ...]
    values: torch.Tensor | None
    ready: torch.cuda.Event | None
    lr: float | None


@dataclass(slots=True)
class LayerSample:
    """Non-zero gradient counts per parameter tensor at a sampled step."""

    step: int
    rank: int
    names: list[str]
    numels: list[int]
    nonzero: torch.Tensor
    ready: torch.cuda.Event | None


def _wait(ready: torch.cuda.Event | None) -> None:
    if ready is not None:
        ready.synchronize()


def step_record(sample: StepSample) -> wire.StepRecord:
    _wait(sample.ready)
    values = dict(
        zip(sample.fields, sample.values.tolist() if sample.values is not None else (), strict=True)
    )
    lr = values.get("lr", sample.lr)
    found_inf = values.get("found_inf")
    return {
        "step": sample.step,
        "loss": wire.encode_float(values.get("loss")),
        "loss_scale": wire.encode_float(values.get("loss_scale")),
        "skipped": found_inf is not None and found_inf > 0,
        "grad_norm": None,
        "lr": wire.encode_float(lr),
        "act_norm_mean": wire.encode_float(values.get("act_norm_mean")),
        "act_norm_max": wire.encode_float(values.get("act_norm_max")),
        "rank": sample.rank,
    }


def layer_record(sample: LayerSample) -> wire.LayerStatsRecord:
    _wait(sample.ready)
    fractions = zero_fractions(sample.numels, sample.nonzero.tolist())
    return {
        "step": sample.step,
        "rank": sample.rank,
        "names": sample.names,
        "stats": {"zero_fraction": wire.encode_floats(fractions)},
    }
