"""Samples (what the training thread hands over) and the wire records built from them.

The training thread only launches device reductions and copies; the sender thread calls
`step_record` / `layer_record`, which wait for the copy (a CUDA event) and do the host-side
arithmetic, so no statistic costs a host sync where it is measured.

torch appears here in annotations only, and `agent.stats` (which imports it) is imported
by `layer_record`: the log importer builds step records from parsed numbers through this
module, and `ampwatch import`/`follow` must not spend seconds importing torch (nor fail on
a collector host that has none) for that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ampwatch.agent import wire

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class StepSample:
    """One optimizer step: `values` (CPU, maybe still being copied) aligned with `fields`,
    plus values already on the host (`host`: a float lr, numbers given to `record()`).
    `found_inf` > 0 in either means the step was skipped. `lr_groups` > 1: the lr of group
    i is field `lr_group_field(i)` (in `fields` when it was a device tensor, else in `host`).
    """

    step: int
    rank: int
    fields: tuple[str, ...]
    values: torch.Tensor | None
    ready: torch.cuda.Event | None
    host: dict[str, float | None] = field(default_factory=dict)
    lr_groups: int = 0


def lr_group_field(index: int) -> str:
    """The sample field holding param group `index`'s learning rate."""
    return f"lr_group.{index}"


@dataclass(slots=True)
class LayerSample:
    """The `stats.gradient_range` tensor of a sampled step, per parameter tensor `names`;
    `activations`: (leaf module paths, their max-abs, copy event) when measured."""

    step: int
    rank: int
    names: list[str]
    numels: list[int]
    values: torch.Tensor
    ready: torch.cuda.Event | None
    direct: bool
    activations: tuple[list[str], torch.Tensor, torch.cuda.Event | None] | None = None


def _wait(ready: torch.cuda.Event | None) -> None:
    if ready is not None:
        ready.synchronize()


def host_list(values: torch.Tensor) -> list[float]:
    """`values.tolist()` of a plain tensor; a tensor subclass (whose `.tolist()` may run a
    collective, or raise) is converted to its local part or refused with a TypeError, which
    costs the record, not the sender thread (`batching`)."""
    from ampwatch.agent.shards import local_tensor  # torch, loaded by whoever made `values`

    local = local_tensor(values)
    if local is None:
        raise TypeError(f"not a plain tensor: {type(values).__name__}")
    result: list[float] = local.tolist()
    return result


def step_record(sample: StepSample) -> wire.StepRecord:
    _wait(sample.ready)
    values: dict[str, float | None] = dict(sample.host)
    if sample.values is not None:
        values.update(zip(sample.fields, host_list(sample.values), strict=True))
    found_inf = values.get("found_inf")
    record: wire.StepRecord = {
        "step": sample.step,
        "loss": wire.encode_float(values.get("loss")),
        "loss_scale": wire.encode_float(values.get("loss_scale")),
        "skipped": found_inf is not None and found_inf > 0,
        "grad_norm": wire.encode_float(values.get("grad_norm")),
        "lr": wire.encode_float(values.get("lr")),
        "act_norm_mean": wire.encode_float(values.get("act_norm_mean")),
        "act_norm_max": wire.encode_float(values.get("act_norm_max")),
        "rank": sample.rank,
    }
    if (clipped := values.get("grad_norm_clipped")) is not None:
        record["grad_norm_clipped"] = wire.encode_float(clipped)
    sumsq = wire.encode_float(values.get("grad_sumsq"))
    if sumsq is not None and (parts := values.get("grad_parts")):
        record["grad_sumsq"] = sumsq  # this rank's part of a sharded grad norm (`wire`)
        record["grad_parts"] = int(parts)
    if (prenorm := values.get("act_prenorm_mean")) is not None:
        record["act_prenorm_mean"] = wire.encode_float(prenorm)
        record["act_prenorm_max"] = wire.encode_float(values.get("act_prenorm_max"))
    for name in wire.PRECURSOR_FIELDS:
        if (precursor := values.get(name)) is not None:  # absent: no Adam-family optimizer
            record[name] = wire.encode_float(precursor)
    if sample.lr_groups > 1:
        groups = [values.get(lr_group_field(i)) for i in range(sample.lr_groups)]
        lrs = [lr for lr in groups if lr is not None]
        if len(lrs) == len(groups):  # a null in the list would cost the collector the batch
            record["lr_groups"] = wire.encode_floats(lrs)
    return record


def layer_record(sample: LayerSample) -> wire.LayerStatsRecord:
    from ampwatch.agent.stats import histogram_spans, range_fractions

    _wait(sample.ready)
    stats, hists = range_fractions(host_list(sample.values), sample.numels, direct=sample.direct)
    record: wire.LayerStatsRecord = {
        "step": sample.step,
        "rank": sample.rank,
        "names": sample.names,
        "stats": {name: wire.encode_floats(values) for name, values in stats.items()},
        "exponent_histograms": histogram_spans(hists),
    }
    if sample.activations is not None:
        names, max_abs, ready = sample.activations
        _wait(ready)
        record["activations"] = {"names": names, "max_abs": wire.encode_floats(host_list(max_abs))}
    return record
