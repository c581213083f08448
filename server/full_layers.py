"""A sharded run's per-layer gradient figures of the full tensors, combined over its ranks.

Under FSDP1/FSDP2 each rank measures only its local shard of every gradient (the agent never
runs a collective, `ampwatch.agent.shards`), so each rank's layer record describes its
shard. This module combines one step's records of every rank into the figures of the whole
gradient, on the collector, when asked (`GET /api/v1/runs/{id}/layers/full`).

What combines, and how exactly:
- Element counts add. A rank's shard size is the sum of its exponent histogram (every
  element falls in one bin), so the full tensor's `numel`, the zero, subnormal and flush
  counts (each fraction times its rank's shard size, rounded: the agent's fraction is a
  count over that size) and the exponent histogram itself (bin by bin) are exact.
  The fractions are those counts over the full size: exact to the last ulp.
- `max_abs_scaled` is the maximum of the ranks' maxima: exact (NaN if any rank's is NaN).
- Not combined, and not answered: the FP8 statistics (a per-tensor, tile or block scale
  of a shard is not the full tensor's; the relative quantisation error needs norms the
  agent does not send; a spread is a ratio of extremes over groups the shard boundary may
  cut) and activation maxima (not sharded: each rank's own micro-batch). No per-layer sum
  of squares is sent, so there is no per-layer norm to add up; the step's global norm is
  combined at ingest (`grad_norm_parts`).
- A shard replicated over k ranks (FSDP1 NO_SHARD and hybrid, FSDP2's HSDP: the agent's
  `run_start` says how many, `shard_replicas`) is counted once: the sums are divided by k. Ranks of
  an unsharded run (DDP, one process) hold the whole reduced gradient: the lowest rank's
  record is the answer, as it is.
- FSDP1 flat parameters (`use_orig_params=False`) pad each flat parameter's last shard
  with up to world_size - 1 zeros: they are counted (as zeros) like the elements.

A layer that fewer ranks reported than the run has (`world_size`) is answered from those
that did, with `ranks` saying how many: a partial figure is never passed off as whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import LAYER_STATS, WireFloat, encode_float
from ampwatch.server.fp8_readiness import latest_run_start
from ampwatch.server.layer_models import Layer, LayerHistogram, LayerStat
from ampwatch.server.packed import unpack_matrix
from ampwatch.server.schemas.runs import FullLayer, FullLayers

#: The statistics that are shares of a shard's elements (they add as counts).
FRACTIONS = ("zero_fraction", "subnormal_fraction", "flush_fraction")
#: The statistic that composes by maximum.
MAXIMUM = "max_abs_scaled"
#: `run_start`'s `sharding` values under which ranks hold disjoint shards.
SHARDED = ("fsdp1", "fsdp2")


@dataclass
class _Sum:
    """One layer's running totals over the ranks."""

    ranks: int = 0
    numel: int = 0
    counts: dict[str, int | None] = field(default_factory=dict)
    peak: float | None = None
    histogram: np.ndarray | None = None
    first_bin: int = 0
    sized: bool = True  # every combined rank had a histogram (its shard size)

    def add_histogram(self, first_bin: int, counts: np.ndarray) -> None:
        self.numel += int(counts.sum())
        if self.histogram is None:
            self.histogram, self.first_bin = counts.copy(), first_bin
            return
        low = min(self.first_bin, first_bin)
        high = max(self.first_bin + self.histogram.size, first_bin + counts.size)
        merged = np.zeros(high - low, dtype=np.int64)
        merged[self.first_bin - low : self.first_bin - low + self.histogram.size] += self.histogram
        merged[first_bin - low : first_bin - low + counts.size] += counts
        self.histogram, self.first_bin = merged, low


def latest_sampled_step(session: Session, run_id: int) -> int | None:
    """The last step at which any rank sent layer statistics."""
    latest = select(func.max(LayerStat.step)).where(
        LayerStat.run_id == run_id, LayerStat.stat.in_(LAYER_STATS)
    )
    return session.scalar(latest)


def full_layer_stats(session: Session, run_id: int, step: int) -> FullLayers | None:
    """The figures of every layer's full gradient at `step`, combined over the ranks'
    records (module docstring); None when no rank sent layer statistics at that step.

    >>> full_layer_stats(session, run_id, 101).layers[0].zero_count  # doctest: +SKIP
    3
    """
    start = latest_run_start(session, run_id)
    sharding = start.get("sharding") if start.get("sharding") in SHARDED else None
    world = _positive(start.get("world_size"))
    replicas = _positive(start.get("shard_replicas")) or 1
    names = list(
        session.scalars(select(Layer.name).where(Layer.run_id == run_id).order_by(Layer.idx))
    )
    rows = session.execute(
        select(LayerStat.rank, LayerStat.stat, LayerStat.values).where(
            LayerStat.run_id == run_id, LayerStat.step == step, LayerStat.stat.in_(LAYER_STATS)
        )
    ).all()
    if not rows:
        return None
    ranks = sorted({rank for rank, _, _ in rows})
    if sharding is None:  # every rank holds the whole gradient: the lowest rank's record
        ranks = ranks[:1]
    stats: dict[tuple[int, str], np.ndarray] = {}
    measured: dict[int, np.ndarray] = {}
    for rank, stat, blob in rows:
        if rank in ranks:
            values, missing = unpack_matrix([blob], len(names))
            stats[rank, stat] = values[0]
            measured[rank] = measured.get(rank, np.zeros(len(names), bool)) | ~missing[0]
    histograms = session.execute(
        select(LayerHistogram.rank, LayerHistogram.layer_idx, LayerHistogram.first_bin,
               LayerHistogram.counts)
        .where(LayerHistogram.run_id == run_id, LayerHistogram.step == step,
               LayerHistogram.rank.in_(ranks))
    ).all()  # fmt: skip
    sizes = {(rank, idx): (first, np.frombuffer(c, "<i8")) for rank, idx, first, c in histograms}
    sums = [_Sum() for _ in names]
    for rank in ranks:
        for idx in np.flatnonzero(measured[rank]):
            _add_rank(sums[idx], stats, sizes.get((rank, int(idx))), rank, int(idx))
    layers = [
        _answer(name, total, replicas)
        for name, total in zip(names, sums, strict=True)
        if total.ranks
    ]
    return FullLayers(
        run_id=run_id, step=step, sharding=sharding,
        combined="shards" if sharding is not None else "replicated",
        world_size=world, replicas=replicas, ranks=ranks, layers=layers,
    )  # fmt: skip


def _positive(value: object) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None  # type: ignore[return-value]


def _add_rank(
    total: _Sum,
    stats: dict[tuple[int, str], np.ndarray],
    histogram: tuple[int, np.ndarray] | None,
    rank: int,
    idx: int,
) -> None:
    """Add one rank's record of one layer to its totals."""
    total.ranks += 1
    if histogram is None:
        total.sized = False
    else:
        size = int(histogram[1].sum())
        total.add_histogram(*histogram)
        for stat in FRACTIONS:
            values = stats.get((rank, stat))
            share = float(values[idx]) if values is not None else math.nan
            prior = total.counts.get(stat, 0)  # None: unmeasured on a rank, so no total
            unknown = prior is None or not math.isfinite(share)
            total.counts[stat] = None if prior is None or unknown else prior + round(share * size)
        if size == 0:
            return  # an empty shard has no maximum
    peaks = stats.get((rank, MAXIMUM))
    if peaks is not None:
        peak = float(peaks[idx])
        nan = math.isnan(peak) or (total.peak is not None and math.isnan(total.peak))
        total.peak = math.nan if nan else max(peak, total.peak if total.peak is not None else peak)


def _answer(name: str, total: _Sum, replicas: int) -> FullLayer:
    peak = encode_float(total.peak)
    if not total.sized or total.histogram is None:
        return FullLayer(layer=name, ranks=total.ranks, numel=None, zero_count=None,
                         zero_fraction=None, subnormal_fraction=None, flush_fraction=None,
                         max_abs_scaled=peak, first_bin=None, counts=None)  # fmt: skip
    numel = total.numel // replicas
    counts = {stat: n // replicas if n is not None else None for stat, n in total.counts.items()}

    def share(stat: str) -> WireFloat | None:
        count = counts.get(stat)
        return None if count is None or numel == 0 else encode_float(count / numel)

    return FullLayer(
        layer=name, ranks=total.ranks, numel=numel, zero_count=counts.get("zero_fraction"),
        zero_fraction=share("zero_fraction"), subnormal_fraction=share("subnormal_fraction"),
        flush_fraction=share("flush_fraction"), max_abs_scaled=peak, first_bin=total.first_bin,
        counts=(total.histogram // replicas).tolist(),
    )  # fmt: skip
