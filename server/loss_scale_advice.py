"""Loss-scale advice for FP16 runs, from the gradients' exponent histograms the agent
stored: which scales S = 2^k flush nothing and overflow nothing, and the GradScaler's
`init_scale` / `growth_interval` to use.

Reads are bounded whatever the run's length: <= `max_steps` sampled steps' histograms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel
from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from ampwatch.agent import wire
from ampwatch.server.fp8_readiness import latest_run_start, layer_vectors, percent, thin_steps
from ampwatch.server.layer_models import LayerHistogram
from ampwatch.server.step_models import Step

#: Histogram field f holds |g| in [2^(f-127), 2^(f-126)); at S = 2^k a bin flushes in FP16
#: exactly when f <= 102 - k (|g S| < 2^-24 is a bin boundary) and may overflow when
#: f >= 142 - k (its top reaches 2^16 > 65504; 65504 is inside bin 142 - k, so the bins
#: alone bound it from above, and a range read from them alone stopped one power of two
#: short whenever max |g| S <= 65504 < 2^16: gradients up to 12 gave [7, 11] for [7, 12]).
#: The top end is exact from the stored `max_abs_scaled` (max |g S| at the step's S, a
#: power of two for a GradScaler: max |g| exactly) (`_max_abs`, `_top_exponent`); the bins
#: bound it where that max is unknown. Field 0 (zeros, float32 subnormals) and 255
#: (Inf/NaN) are left out.
_FLUSH_TOP = wire.EXPONENT_BIAS - 25
_OVERFLOW_FROM = wire.EXPONENT_BIAS + 15


class ScaleRow(BaseModel):
    exponent: int
    scale: float
    flush: float
    overflow: float


class LossScaleAdvice(BaseModel):
    run_id: int
    rank: int
    applies: bool
    why: str
    steps_read: int
    steps_sampled: int
    #: exponents k with 0 flush and 0 possible overflow in every histogram read (null: none).
    safe_range: tuple[int, int] | None
    init_scale: float | None
    growth_interval: int | None
    reason: str
    table: list[ScaleRow]


def _fp16_run(start: dict[str, object]) -> tuple[bool, str]:
    precision = str(start.get("precision") or "")
    if start.get("scaler") or "fp16" in precision:
        return True, f"the run uses FP16 ({precision or 'a GradScaler'})"
    if not start:
        return False, "the run has not reported its precision (no run_start)"
    return False, f"the run is not FP16 ({precision}): BF16 and FP32 need no loss scale"


def loss_scale_advice(
    session: Session, run_id: int, *, rank: int = 0, max_steps: int = 64
) -> LossScaleAdvice:
    """Which loss scales S = 2^k would have flushed nothing and overflowed nothing in the
    gradients so far (their exponent histograms, <= max_steps sampled steps spread over the
    run), and an `init_scale` / `growth_interval` suggestion with its reason."""
    applies, why = _fp16_run(latest_run_start(session, run_id))
    sampled = list(session.scalars(
        select(LayerHistogram.step).where(LayerHistogram.run_id == run_id,
                                          LayerHistogram.rank == rank)
        .distinct().order_by(LayerHistogram.step)
    ))  # fmt: skip
    steps = thin_steps(sampled, max_steps)
    totals = np.zeros(wire.EXPONENT_HISTOGRAM_BINS, dtype=np.int64)
    low_field, high_field = wire.EXPONENT_HISTOGRAM_BINS, -1
    rows: Sequence[Row[int, int, int, bytes]] = []
    if steps:
        rows = session.execute(
            select(LayerHistogram.step, LayerHistogram.layer_idx, LayerHistogram.first_bin,
                   LayerHistogram.counts).where(
                LayerHistogram.run_id == run_id, LayerHistogram.rank == rank,
                LayerHistogram.step.in_(steps),
            )
        ).all()  # fmt: skip
        for _, _, first, blob in rows:
            counts = np.frombuffer(blob, dtype="<i8")
            totals[first : first + counts.size] += counts
    finite = totals.copy()
    finite[0] = finite[255] = 0
    present = np.flatnonzero(finite)
    advice = LossScaleAdvice(
        run_id=run_id, rank=rank, applies=applies, why=why, steps_read=len(steps),
        steps_sampled=len(sampled), safe_range=None, init_scale=None, growth_interval=None,
        reason="no exponent histograms yet", table=[],
    )  # fmt: skip
    if present.size == 0:
        return advice
    low_field, high_field = int(present[0]), int(present[-1])
    peak = _max_abs(session, run_id, rank, steps, rows, high_field)
    k_low = _FLUSH_TOP + 1 - low_field
    k_high = _OVERFLOW_FROM - 1 - high_field if peak is None else _top_exponent(peak)
    total = int(finite.sum())
    cumulative = np.cumsum(finite)

    def row(k: int) -> ScaleRow:
        flush_top = min(254, _FLUSH_TOP - k)
        flush = int(cumulative[flush_top]) if flush_top >= 1 else 0
        overflow_from = max(1, _OVERFLOW_FROM - k)
        overflow = int(total - cumulative[overflow_from - 1]) if overflow_from <= 254 else 0
        if k <= k_high:  # max |g| S <= 65504 (exact when the max is known)
            overflow = 0
        return ScaleRow(exponent=k, scale=2.0**k, flush=flush / total, overflow=overflow / total)

    span = range(min(k_low, k_high) - 2, max(k_low, k_high) + 3)
    advice.table = [row(k) for k in span if -126 <= k <= 127]
    if k_low <= k_high:
        advice.safe_range = (k_low, k_high)
        best = row(k_high)
        octaves = k_high - k_low
        # GradScaler grows from init_scale by 2x every growth_interval clean steps and halves
        # on overflow: start at the top of the safe range; where the range is narrow, every
        # growth past it costs a skipped step, so grow seldom.
        growth = 2000 if octaves >= 4 else 10000
        advice.init_scale, advice.growth_interval = 2.0**k_high, growth
        advice.reason = (
            f"with S = 2^{k_high}: {percent(best.flush)} flush, {percent(best.overflow)} overflow "
            f"(at most); every S from 2^{k_low} to 2^{k_high} ({octaves + 1} powers of two) "
            "flushed and overflowed nothing in the histograms read; "
            + (
                "the range is wide, so torch's default growth_interval 2000 costs little"
                if octaves >= 4
                else f"the range is narrow: each growth beyond 2^{k_high} overflows and skips a "
                "step, so grow every 10000 steps"
            )
        )
    else:
        # No scale is clean: the gradients span more than FP16's range. Pick the scale that
        # overflows nothing and flushes least (overflow skips steps; flush loses updates).
        clean = [r for r in advice.table if r.overflow == 0] or advice.table
        best = min(clean, key=lambda r: (r.overflow, r.flush))
        advice.init_scale, advice.growth_interval = best.scale, 10000
        advice.reason = (
            f"no scale is clean: the gradients span {high_field - low_field + 1} binary orders "
            f"of magnitude, more than FP16's 40; with S = 2^{best.exponent}: "
            f"{percent(best.flush)} flush, {percent(best.overflow)} overflow (at most); "
            "consider BF16"
        )
    return advice


def _top_exponent(peak: float) -> int:
    """The largest k with peak x 2^k <= 65504 (FP16's max), exactly: peak = m 2^e with m in
    [0.5, 1), and 65504 = (65504 / 65536) 2^16.

    >>> _top_exponent(12.0), _top_exponent(65504 / 4096), _top_exponent(16.0)
    (12, 12, 11)
    """
    mantissa, exponent = math.frexp(peak)
    return (16 if mantissa <= wire.FP16_MAX / 2.0**16 else 15) - exponent


def _max_abs(
    session: Session,
    run_id: int,
    rank: int,
    steps: list[int],
    histograms: Sequence[Row[int, int, int, bytes]],
    high_field: int,
) -> float | None:
    """max |g| over the histograms read, from the stored max |g S| and the step's loss
    scale S (none: 1), or None where a histogram reaching `high_field` has no finite max
    (a layer with an Inf/NaN gradient, or no `max_abs_scaled` stored): the bins bound it."""
    width = max((layer for _, layer, _, _ in histograms), default=-1) + 1
    maxima = layer_vectors(session, run_id, rank, ["max_abs_scaled"], steps, width)
    scales = dict(
        session.execute(
            select(Step.step, Step.loss_scale).where(Step.run_id == run_id, Step.step.in_(steps))
        ).all()
    )
    peak = 0.0
    for step, layer, first, blob in histograms:
        fields = first + np.flatnonzero(np.frombuffer(blob, dtype="<i8"))
        fields = fields[(fields > 0) & (fields < 255)]
        top = int(fields[-1]) if fields.size else -1
        vector = maxima.get(("max_abs_scaled", step))
        value = math.nan if vector is None else float(vector[layer])
        scale = scales.get(step)
        value /= 1.0 if scale is None or not math.isfinite(scale) or scale <= 0 else scale
        if not math.isfinite(value) or value <= 0:
            if top >= high_field:
                return None
            continue
        peak = max(peak, value)
    if peak <= 0 or math.frexp(peak)[1] + wire.EXPONENT_BIAS - 1 != high_field:
        return None  # the stored maxima disagree with the histograms: trust the bins
    return peak
