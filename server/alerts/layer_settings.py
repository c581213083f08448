"""The per-layer rules' settings (`silent_underflow`, `underflow_risk`, `fp8_risk`,
`flush_trend`): their conditions are counted in samples of the layer as well as in steps.
The run-scope rules' and the common fields: `rule_settings`."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ampwatch.server.alerts.rule_settings import RuleSettings, TimedRule, hold_for, resolve_after
from ampwatch.server.fp8_readiness import Fp8Limits

_FOR_SAMPLES = (
    "Consecutive samples of the layer the condition must hold on before the alert fires: "
    "one bad sample is noise, three are a trend. Counted in samples, not steps, so denser "
    "layer sampling fires sooner (the 3rd sample is step +40 at the agent's default of one "
    "sample per 20 steps, step +10 at one per 5)."
)


def _for_samples(default: int) -> Any:
    return Field(default=default, ge=1, le=10_000, description=_FOR_SAMPLES)


class SilentUnderflow(RuleSettings):
    for_steps: int = hold_for(
        0, "Steps the excess must also be sustained, on top of for_samples (0: samples only)."
    )
    for_samples: int = _for_samples(3)
    resolve_steps: int = resolve_after(100)
    min_increase: float = Field(
        default=0.3,
        gt=0,
        le=1,
        description="Fire when a layer's zero-gradient fraction exceeds its own baseline by "
        "this much (absolute): structural zeros (unused embedding rows, dead ReLUs) are in "
        "the baseline and never fire.",
    )
    spread_factor: float = Field(
        default=6.0,
        ge=0,
        description="...and by this many times the layer's own mean absolute deviation, so "
        "a naturally noisy layer (an embedding whose used rows vary by batch) needs more.",
    )
    baseline_samples: int = Field(
        default=5, ge=1, description="Samples of a layer averaged before it is judged."
    )
    baseline_alpha: float = Field(
        default=0.05,
        gt=0,
        le=1,
        description="EWMA weight of a new healthy sample in the baseline (~20 samples).",
    )
    frozen_max_baseline: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="A layer at 100% zeros is 'frozen' (fires regardless of min_increase, "
        "from its first sample) when its baseline is at most this. 1.0: always. Structural "
        "zeros (unused embedding rows, dead units) are partial, never the whole tensor, and "
        "a parameter that gets no gradient has .grad None and is not sampled; lower this "
        "for a model that zeroes unused gradients (zero_grad(set_to_none=False)).",
    )
    explain_window_steps: int = Field(
        default=5,
        ge=0,
        description="A sample within this many steps after a skipped step or a non-finite "
        "loss is explained by it (Inf/NaN), not underflow, and not judged.",
    )


class UnderflowRisk(RuleSettings):
    for_steps: int = hold_for(
        0, "Steps the forecast must also hold, on top of for_samples (0: samples only)."
    )
    for_samples: int = _for_samples(3)
    resolve_steps: int = resolve_after(100)
    max_flush_fraction: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="Fire when this share of a layer's gradient elements would flush "
        "to zero in FP16 (|g*S| < 2^-24): a tenth of the signal about to vanish.",
    )
    max_subnormal_fraction: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="...or when this share sits in FP16's subnormal range at the current "
        "scale (2^-24 <= |g*S| < 2^-14): within 2^10 of flushing, already losing precision. "
        "The forecast of a drift: a run whose loss normaliser grows showed 4% -> 60% -> 95% "
        "over 20 steps, 25+ steps before its first layer froze.",
    )
    only_with_loss_scale: bool = Field(
        default=True,
        description="Judge only runs that report a loss scale (FP16 with a scaler), or FP16 "
        "runs without one (the agent's fp16_params_without_scaler finding; forecast at S = "
        "1): a BF16/FP32 run's FP16 forecast is not a risk to it.",
    )


class Fp8Risk(RuleSettings, Fp8Limits):
    """The limits of "fits" are the FP8 readiness view's own (`Fp8Limits`: one home for the
    rule), overridable here like any threshold."""

    for_steps: int = hold_for(
        0, "Steps the excess must also be sustained, on top of for_samples (0: samples only)."
    )
    for_samples: int = Field(
        default=2,
        ge=1,
        le=10_000,
        description="Consecutive FP8 samples of the layer the recipe must fail on before the "
        "alert fires: one sample can catch one unusual batch (its activations and "
        "gradients); two, fp8_stats_every apart (400 steps at the agent's default of one "
        "sample per 200), are the layer's state.",
    )
    resolve_steps: int = resolve_after(200)
    max_score: float = Field(
        default=1.0,
        gt=0,
        description="Fire when the layer's score under the run's declared recipe (its worst "
        "role's worst flush / saturate / error share as a multiple of that limit) exceeds "
        "this: 1, the recipe no longer fits the layer (the readiness view's verdict).",
    )


class FlushTrend(TimedRule):
    min_flush: float = Field(
        default=0.02, gt=0, le=1,
        description="Fire when a layer's share of scaled gradients below FP16's smallest "
        "subnormal (|g*S| < 2^-24) is at least this...",
    )  # fmt: skip
    min_rise: float = Field(
        default=0.01, gt=0, le=1,
        description="...and rose by at least this since the layer's previous sample: the "
        "drift before a layer is mostly zero (silent_underflow).",
    )  # fmt: skip
