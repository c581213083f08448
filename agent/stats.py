"""Device-side reductions over gradients, and the host-side arithmetic that finishes them.

The training thread only launches reductions; the sender thread turns the copied counts into
fractions, so no statistic costs a host sync where it is measured.

Gradient range, one pass per tensor: the float32 exponent-field histogram (wire
`EXPONENT_HISTOGRAM` layout) holds every range statistic at any power-of-two scale S = 2^k,
because multiplying by 2^k adds k to the exponent exactly. Two things it cannot give are
measured beside it: the exact zero count (field 0 mixes zeros with float32 subnormals) and
the exact max. For a scale that is not a power of two the flush and subnormal counts are
also measured directly, in float64, where |g|·S is exact (24-bit by 24-bit mantissas).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from ampwatch.agent import wire
from ampwatch.agent.shards import local_tensor

_BINS = wire.EXPONENT_HISTOGRAM_BINS
_BIAS = wire.EXPONENT_BIAS
#: |g·S| < 2^-24 (flush) iff the exponent field of g·S is <= 102; FP16 subnormal iff 103..112.
_FLUSH_TOP_FIELD = _BIAS - 24 - 1
_SUBNORMAL_TOP_FIELD = _BIAS - 14 - 1


class RunningMean:
    """Mean of device scalars across micro-batches, kept as one device sum (bounded memory).

    >>> m = RunningMean(); m.add(torch.tensor(1.0)); m.add(torch.tensor(3.0)); m.take()
    tensor(2.)
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._count = 0

    def add(self, value: torch.Tensor) -> None:
        value = value.to(torch.float32)
        self._sum = value if self._sum is None else self._sum + value
        self._count += 1

    @property
    def count(self) -> int:
        """Values added since the last take."""
        return self._count

    def take(self, *, summed: bool = False) -> torch.Tensor | None:
        """Return the mean (the sum with `summed`) since the last take, None if nothing was
        added, and reset. A sum is the step's loss when each micro-batch loss was already
        divided by the number of micro-batches, as Lightning, HF and accelerate do."""
        if self._sum is None:
            return None
        mean = self._sum if self._count == 1 or summed else self._sum / self._count
        self._sum, self._count = None, 0
        return mean


class Grads(NamedTuple):
    """The gradients to measure: names, this rank's plain local tensors (a DTensor's
    `.to_local()` shard; an empty shard left out), and `present`, the count of parameters
    that had a gradient at all (what a clip that covered them all saw)."""

    names: list[str]
    tensors: list[torch.Tensor]
    present: int


def named_grads(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> Grads:
    """The gradients to measure, by parameter name. A parameter whose `.grad` is None (frozen
    or unused) is left out, not reported as zero: it is not an underflowing one. A gradient
    of a tensor subclass the agent does not know is left out too (`shards.local_tensor`)."""
    names: list[str] = []
    grads: list[torch.Tensor] = []
    present = 0
    for name, param in named_params:
        grad = param.grad
        if grad is None or grad.is_sparse:
            continue
        present += 1
        local = local_tensor(grad)
        if local is not None and local.numel():
            names.append(name)
            grads.append(local.detach())
    return Grads(names, grads, present)


def global_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm over all gradients, computed as `clip_grad_norm_` does (per-tensor
    `_foreach_norm`, then the norm of the stacked norms), so the two agree bit for bit."""
    device = grads[0].device
    norms = torch._foreach_norm(list(grads), 2.0)
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)
    return total


def gradient_range(
    grads: Sequence[torch.Tensor], scale: torch.Tensor, *, direct: bool
) -> torch.Tensor:
    """Launch the range reductions; return ONE flat float64 device tensor, for T tensors:
    [T x 256 exponent-field counts, T zero counts, T max |g·S| (as float32 computes g*S),
    S, and with `direct` T flush and T FP16-subnormal counts measured at S].

    `scale` is the 0-dim scale in effect for the step (float32, on the device); `direct`
    is for a scale that may not be a power of two. float64 holds every count exactly.
    """
    device = grads[0].device
    hists, zeros, peaks, flush, subnormal = [], [], [], [], []
    for grad in grads:
        bits = grad.float().view(torch.int32)
        fields = bits.flatten().bitwise_right_shift(23).bitwise_and_(0xFF)
        hists.append(torch.bincount(fields, minlength=_BINS).to(device, non_blocking=True))
        zeros.append((grad.numel() - torch.count_nonzero(grad)).to(device, non_blocking=True))
        # amax and amin are vectorised single passes; abs().amax() is 10x slower on CPU.
        peak = torch.maximum(grad.amax(), grad.amin().neg()).float()
        peaks.append(peak.to(device, non_blocking=True))
        if direct:
            scaled = grad.double().abs() * scale.to(grad.device, torch.float64)
            in_subnormal = (scaled >= wire.FP16_MIN_SUBNORMAL) & (scaled < wire.FP16_MIN_NORMAL)
            flush.append(((scaled < wire.FP16_MIN_SUBNORMAL) & (grad != 0)).sum().to(device))
            subnormal.append(in_subnormal.sum().to(device))
    parts = [
        torch.cat(hists).to(torch.float64),
        torch.stack(zeros).to(torch.float64),
        (torch.stack(peaks) * scale.to(device)).to(torch.float64),
        scale.to(device, torch.float64).reshape(1),
    ]
    if direct:
        parts += [torch.stack(flush).to(torch.float64), torch.stack(subnormal).to(torch.float64)]
    return torch.cat(parts)


def power_of_two_exponent(scale: float) -> float | None:
    """k with scale == 2^k exactly (-inf for 0), or None when scale is not a power of two.

    >>> power_of_two_exponent(65536.0), power_of_two_exponent(0.25), power_of_two_exponent(3.0)
    (16, -2, None)
    """
    if scale == 0.0:
        return -math.inf
    if not math.isfinite(scale) or scale < 0:
        return None
    mantissa, exponent = math.frexp(scale)
    return exponent - 1 if mantissa == 0.5 else None


def range_fractions(
    values: list[float], numels: list[int], *, direct: bool
) -> tuple[dict[str, list[float]], list[list[int]]]:
    """Host side: the copied `gradient_range` tensor -> (LAYER_STATS fractions, histograms).

    Flush and subnormal shares come from the histogram shifted by k = log2 S when S is a
    power of two, else from the direct counts; without either (S unexpectedly not a power
    of two) they are left out rather than guessed. Field 0's non-zero elements (float32
    subnormals, |g| < 2^-126) all flush while k <= 102; above that they are left out too.

    >>> hist = [0] * 256; hist[0] = hist[100] = 1  # one zero, one |g| in [2^-27, 2^-26)
    >>> stats, _ = range_fractions([*hist, 1.0, 2.0**-26, 2.0], [2], direct=False)
    >>> stats["zero_fraction"], stats["flush_fraction"], stats["subnormal_fraction"]
    ([0.5], [0.5], [0.0])
    """
    count = len(numels)
    hist_end = count * _BINS
    hists = [[int(v) for v in values[i * _BINS : (i + 1) * _BINS]] for i in range(count)]
    zeros = values[hist_end : hist_end + count]
    peaks = values[hist_end + count : hist_end + 2 * count]
    scale = values[hist_end + 2 * count]
    stats: dict[str, list[float]] = {
        "zero_fraction": [z / n for z, n in zip(zeros, numels, strict=True)],
        "max_abs_scaled": peaks,
    }
    k = power_of_two_exponent(scale)
    if k is not None:
        shifted = _shifted_counts(hists, zeros, k)
        if shifted is not None:
            flush, subnormal = shifted
            stats["flush_fraction"] = [f / n for f, n in zip(flush, numels, strict=True)]
            stats["subnormal_fraction"] = [s / n for s, n in zip(subnormal, numels, strict=True)]
    elif direct:
        direct_counts = values[hist_end + 2 * count + 1 :]
        stats["flush_fraction"] = [
            f / n for f, n in zip(direct_counts[:count], numels, strict=True)
        ]
        stats["subnormal_fraction"] = [
            s / n for s, n in zip(direct_counts[count:], numels, strict=True)
        ]
    return stats, hists


def _shifted_counts(
    hists: list[list[int]], zeros: list[float], k: float
) -> tuple[list[int], list[int]] | None:
    """Field f (1..254) holds |g| in [2^(f-127), 2^(f-126)); scaled by 2^k its field is
    f + k: flush fields are f <= 102 - k, FP16-subnormal ones 103 - k <= f <= 112 - k.
    Prefix sums keep this a few operations per tensor on the sender thread."""
    flush_top = 254 if k == -math.inf else min(254, int(_FLUSH_TOP_FIELD - k))
    low = 255 if k == -math.inf else max(1, int(_FLUSH_TOP_FIELD + 1 - k))
    high = -1 if k == -math.inf else min(254, int(_SUBNORMAL_TOP_FIELD - k))
    flush: list[int] = []
    subnormal: list[int] = []
    for hist, zero in zip(hists, zeros, strict=True):
        float32_subnormals = hist[0] - int(zero)
        if float32_subnormals and k > _FLUSH_TOP_FIELD:
            return None
        cumulative = list(itertools.accumulate(hist))
        flush.append(
            float32_subnormals + (cumulative[flush_top] - cumulative[0] if flush_top >= 1 else 0)
        )
        subnormal.append(cumulative[high] - cumulative[low - 1] if high >= low else 0)
    return flush, subnormal


def histogram_spans(hists: list[list[int]]) -> wire.ExponentHistograms:
    """Each histogram's non-empty span, as the wire sends it (offset of the first bin).

    >>> histogram_spans([[0, 2, 0, 5, 0]])
    {'offsets': [1], 'counts': [[2, 0, 5]]}
    """
    offsets: list[int] = []
    counts: list[list[int]] = []
    for hist in hists:
        nonzero = [i for i, c in enumerate(hist) if c]
        first, last = (nonzero[0], nonzero[-1]) if nonzero else (0, -1)
        offsets.append(first)
        counts.append(hist[first : last + 1])
    return {"offsets": offsets, "counts": counts}
