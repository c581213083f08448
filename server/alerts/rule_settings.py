"""Every rule's settings: a pydantic model per rule whose defaults are the documented
defaults (README "Alert rules" has the table with the reason for each), here the run-scope
rules' (the per-layer ones: `layer_settings`). Overrides from the collector's TOML file, a
project and a run are validated against the same model (`alerts.config`), so an unknown
setting or a wrong type is refused with a message that names it.

>>> SkipRate(max_fraction=0.1).window_steps
500
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ampwatch.server.baselines import HEALTHY_LOSS_SCALE

_FOR = "Steps the condition must hold (from its onset) before the alert fires."
_RESOLVE = "Steps the condition must stay clear before a firing alert resolves."


def hold_for(default: int, description: str = _FOR) -> Any:
    """A rule's `for_steps` field."""
    return Field(default=default, ge=0, le=1_000_000, description=description)


def resolve_after(default: int) -> Any:
    """A rule's `resolve_steps` field."""
    return Field(default=default, ge=0, le=1_000_000, description=_RESOLVE)


class RuleSettings(BaseModel):
    """Settings every rule has. Strict: `"5"` is not a number, `1` is not a boolean."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Evaluate this rule at all.")


class TimedRule(RuleSettings):
    """A rule whose alert fires once its condition held `for_steps` and resolves once it
    stayed clear `resolve_steps`: the two fields (defaults 0 and 100) every rule judged
    at each step has; a rule overrides either where its own default differs."""

    for_steps: int = hold_for(0)
    resolve_steps: int = resolve_after(100)


class LossScaleCollapse(TimedRule):
    min_scale: float = Field(
        default=HEALTHY_LOSS_SCALE,
        ge=0,
        description="Fire when the loss scale falls below this, or skips at it, while it is "
        "still falling (trend_steps), whatever floor the run reports (DeepSpeed and Megatron "
        "floor at 1; OPT-175B restarted from checkpoints whose scale was still >= 1).",
    )
    fall_octaves: int = Field(
        default=8,
        ge=1,
        le=128,
        description="Fire when the scale fell by 2^this within window_steps and has not "
        "recovered: a healthy scaler halves once per overflow and regrows every "
        "growth_interval (2000) clean steps, so 8 unrecovered halvings is an overflow storm.",
    )
    window_steps: int = Field(
        default=1000, ge=1, le=100_000, description="Window of the fall test, in steps."
    )
    max_consecutive_skips: int = Field(
        default=10,
        ge=1,
        description="Fire at this many skipped steps in a row: one halving cures a real "
        "overflow, so 10 in a row (a 1024x fall) means scaling no longer helps.",
    )
    calibration_clean_steps: int = Field(
        default=50,
        ge=1,
        description="Warm-up calibration (the first backoff cascade from a high initial "
        "scale) ends at the first run of this many unskipped steps.",
    )
    calibration_max_steps: int = Field(
        default=500,
        ge=0,
        description="...or this many steps after the run's (or a resumed process's) first "
        "step, whichever comes first: a cascade that never settles is not calibration.",
    )
    calibration_start_steps: int = Field(
        default=2,
        ge=0,
        description="A process calibrates only when one of its first this-many steps is "
        "skipped: a fresh scaler that starts too high overflows on its first backward (a "
        "hysteresis of 2 on its second), while one restored from a checkpoint starts "
        "calibrated, so a cascade after clean steps (BigScience tr8b-104B: resumed, 2 clean "
        "steps, then 6 of 7 skipped, then NaN) is an incident.",
    )
    floor_headroom_octaves: int = Field(
        default=4,
        ge=1,
        le=64,
        description="When the run reports its scaler's floor (run_start min_loss_scale): fire "
        "at a skip attempted below 2^this times it, falling or not: that skip's halving and a "
        "burst of 3 more (overflow_burst) would take the scale below the floor, where fairseq "
        "stops training and DeepSpeed and Megatron skip every step (a healthy DeepSpeed-Chat "
        "run skipped at 16 over its floor 1: a burst would leave it at the floor).",
    )
    trend_steps: int = Field(
        default=50,
        ge=1,
        le=100_000,
        description="A scale below min_scale fires only while it is falling: within this "
        "many steps it fell by 2^trend_octaves or trend_skips steps were skipped. A stable "
        "low scale (a fairseq run sitting at 0.5 for thousands of steps, one overflow per "
        "epoch) is a healthy scaler, not a collapse; once fired, it holds while below.",
    )
    trend_octaves: int = Field(
        default=2,
        ge=1,
        le=128,
        description="Halvings within trend_steps that make a low scale a falling one (one "
        "halving is any single overflow's).",
    )
    trend_skips: int = Field(
        default=2,
        ge=1,
        description="...or this many skipped steps within trend_steps at or below min_scale "
        "(fairseq: overflows at 0.001 and 0.0005 before 'Minimum loss scale reached').",
    )


class SkipRate(TimedRule):
    window_steps: int = Field(
        default=500, ge=10, le=100_000, description="Window over which skips are counted."
    )
    max_fraction: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="Fire above this share of skipped steps in the window: a healthy "
        "GradScaler skips about one step per growth_interval (0.05%), and even a scaler "
        "with growth_interval 100 stays near 1%.",
    )
    min_steps: int = Field(
        default=100,
        ge=1,
        description="Evaluate once the window holds this many post-calibration steps.",
    )


class ScaleFloorStall(TimedRule):
    resolve_steps: int = resolve_after(10)
    window_steps: int = Field(
        default=50,
        ge=2,
        description="Fire when this many steps in a row were skipped at one unchanged scale: "
        "a scaler that halves on overflow would have fallen 2^50, so the scale sits at a "
        "floor (DeepSpeed/Megatron 1, OPT-175B run12 0.25) and training has stopped.",
    )
    floor_skips: int = Field(
        default=3,
        ge=2,
        description="...or at once, after this many steps in a row skipped at one unchanged "
        "scale of at most floor_max_scale: the scaler's own behaviour says it is floored "
        "(DeepSpeed 'Attempted loss scale: 1, reducing to 1'); a hysteresis skip leaves the "
        "scale unchanged only once. A run that reports its floor (run_start min_loss_scale) "
        "fires at its first skip at that floor instead.",
    )
    floor_max_scale: float = Field(
        default=1.0,
        ge=0,
        description="Largest scale treated as a floor by floor_skips when the run reports "
        "none (DeepSpeed and Megatron floor at 1; an unreported floor above it is reached "
        "after window_steps).",
    )


class OverflowBurst(TimedRule):
    min_skips: int = Field(
        default=3,
        ge=2,
        description="Fire when this many steps in a row (no applied step between them) were "
        "skipped within window_steps after calibration, whatever the scale: a healthy scaler "
        "skips one step per overflow (two with DeepSpeed's hysteresis of 2) and the next "
        "applies, so a third in a row is a storm (tr8b-104B: 6 of 7 at 2^20 -> 2^15, then "
        "NaN; a floored scaler never falls below 1). Overflows with applied steps between "
        "were each cured by a halving (DeepSpeed-Chat's reward model: 483, 486, 487, healthy).",
    )
    window_steps: int = Field(
        default=8, ge=2, le=10_000, description="Window of the burst, in steps."
    )


class NanLoss(TimedRule):
    """`nan_loss`: the timing fields only."""


class ActivationNormSpike(TimedRule):
    signal: Literal["act_norm_mean", "act_norm_max"] = Field(
        default="act_norm_mean",
        description="Which final-layer norm to watch (metaseq's actv_norm is the mean); "
        "the other is used when this one is not reported.",
    )
    baseline_steps: int = Field(
        default=128,
        ge=8,
        le=4096,
        description="Robust rolling baseline: median and MAD of this many recent steps; "
        "short enough (a median ~64 steps behind) to follow the norm's fast growth early "
        "in training, long enough that a spike of a few steps cannot move it.",
    )
    min_baseline_steps: int = Field(
        default=50, ge=4, description="Steps of baseline needed before judging a spike."
    )
    z_threshold: float = Field(
        default=10.0,
        gt=0,
        description="Robust z-score (x - median) / (1.4826 MAD) above which a step spikes: "
        "ordinary step-to-step noise stays below 4.",
    )
    min_ratio: float = Field(
        default=2.0,
        ge=1,
        description="...and x at least twice the median: a very flat baseline (tiny MAD) "
        "must not page on a few percent, and divergence spikes (OPT-175B) are multiples.",
    )
    scale_fall_window: int = Field(
        default=50,
        ge=0,
        description="Critical when the loss scale fell by 2^scale_fall_octaves within this "
        "many steps of the spike (the OPT-175B divergence signature).",
    )
    scale_fall_octaves: int = Field(
        default=2,
        ge=1,
        le=128,
        description="Halvings within scale_fall_window that make a falling scale: one "
        "halving is what a healthy scaler does on any single overflow (a corrupted batch's "
        "own step included); a second one means the overflows go on.",
    )


class RollingSpike(TimedRule):
    """A value judged against the median of its own recent values (loss_spike,
    grad_norm_spike): the fields both rules share."""

    baseline_samples: int = Field(
        default=32,
        ge=1,
        le=4096,
        description="Baseline: the median of this many recent finite values (logged values: "
        "one per step, or one per log interval; a grad norm only of applied steps). The "
        "median ignores a few earlier spikes.",
    )
    min_baseline_samples: int = Field(
        default=1,
        ge=1,
        description="Judge once this many values are in the baseline: logs often show a "
        "value per 10 steps, and a jump of min_ratio (and min_increase) over the last one is "
        "already rare in healthy training (BigScience tr8-104B: loss 6.44 -> 11.42 in 10 "
        "steps, NaN later).",
    )
    z_threshold: float = Field(
        default=6.0,
        gt=0,
        description="...and, once z_min_samples are in the baseline, a robust z-score (x - "
        "median) / (1.4826 MAD) of at least this (OLMo-core flags 6 sigma).",
    )
    z_min_samples: int = Field(
        default=16, ge=2, description="Baseline size from which the z-score is required."
    )


class LossSpike(RollingSpike):
    for_steps: int = hold_for(
        1,
        "Steps of training the spike must cover (from the first step its logged value "
        "stands for) before the alert fires: a value printed every 10 steps covers 10 and "
        "fires at once; a value logged every step fires when the next step spikes too. One "
        "batch's outlier, back at the next step, is a hard batch, not a divergence (NanoGPT "
        "speedrun records: loss 3.86 -> 5.06 -> 3.79 at the same step in every record, all "
        "reaching their target).",
    )
    min_ratio: float = Field(
        default=1.3,
        gt=1,
        description="Fire when the loss is at least this many times its baseline median...",
    )
    min_increase: float = Field(
        default=1.0,
        ge=0,
        description="...and at least this much above it (loss units: 1 nat of cross-entropy "
        "is a large jump; a fine-tuning loss of 0.05 doubling is noise). 0 for other losses.",
    )


class GradNormSpike(RollingSpike):
    min_ratio: float = Field(
        default=10.0,
        gt=1,
        description="Fire when the grad norm is at least this many times its baseline median: "
        "healthy norms wander by a few x (BigScience tr8-104B: 9e4 to 3e5); the spikes "
        "before loss spikes are 10-100x (tr11-176B: 0.24 -> 15.9 two steps before the "
        "loss spiked, tr8-104B: 2e5 -> 3.3e6).",
    )
    min_increase: float = Field(
        default=0.0, ge=0, description="...and at least this much above it (norm units)."
    )


class LossCollapse(TimedRule):
    """`loss_collapse` (`alerts.collapse`): judged against loss_spike's and
    grad_norm_spike's rolling medians (their baseline_samples)."""

    for_steps: int = hold_for(
        1,
        "Steps of training the collapse must cover (from the first step its first collapsed "
        "value stands for) before the alert fires: a per-step log fires at its second "
        "collapsed step, a line printed every 10 steps at once.",
    )
    orders: float = Field(
        default=3.0,
        gt=0,
        le=300,
        description="Fire when the loss (or the grad norm of an applied step) falls to "
        "10^-this times its rolling median or below, 0 included: OLMo #692's cross-entropy "
        "fell 12.18 -> 1.8e-06 -> 0.0 and its grad norm 231.7 -> 0.0002 in one step each.",
    )
    converging_orders: float = Field(
        default=1.0,
        ge=0,
        le=300,
        description="...in one log interval: the value logged before it was still within "
        "10^this of the median. A run converging to a small loss gets there a few times "
        "lower per interval, its median following it down.",
    )


class UpdateRmsRise(TimedRule):
    resolve_steps: int = resolve_after(50)
    baseline_samples: int = Field(
        default=64, ge=2, le=4096,
        description="Baseline: the median of this many recent applied steps' adam_rms_max "
        "(the update RMS, sqrt(mean(g^2 / v_hat)), maximum over layers).",
    )  # fmt: skip
    min_baseline_samples: int = Field(
        default=50, ge=1,
        description="Judge once this many values are in the baseline: Adam's first steps "
        "(bias correction, lr warm-up) move the update RMS by themselves.",
    )  # fmt: skip
    min_ratio: float = Field(
        default=2.5, gt=1,
        description="Fire when the update RMS is at least this many times its median: in "
        "steady training it sits near 1 (v_hat is the running mean of g^2); a lagging "
        "second moment pushes it towards sqrt(1 / (1 - beta2)).",
    )  # fmt: skip
    min_value: float = Field(
        default=2.5, gt=0,
        description="...and at least this (Wortsman et al. 2023 clip the update where it "
        "exceeds 1).",
    )  # fmt: skip
    escalate_ratio: float = Field(
        default=3.0, gt=1,
        description="Critical when, at the same step, the grad norm is this many times the "
        "median of its last baseline_samples applied steps (a precursor and a rise together).",
    )  # fmt: skip


class ScaleDecline(TimedRule):
    window_steps: int = Field(
        default=200, ge=1, le=100_000, description="Window of the decline, in steps."
    )
    min_octaves: float = Field(
        default=3.0, gt=0,
        description="Fire when the scale fell by 2^this within window_steps and did not grow "
        "in that window (64 -> 4 over 200 steps is 4: below loss_scale_collapse's 2^8 and "
        "its floor; a scaler that grows inside the window is cycling, not declining).",
    )  # fmt: skip
    min_falls: int = Field(
        default=3, ge=1,
        description="...in at least this many separate falls: a decline, not one overflow.",
    )  # fmt: skip


class NoData(RuleSettings):
    stale_seconds: float = Field(
        default=600.0,
        gt=0,
        description="Fire when a running run sent nothing for this long: the agent retries "
        "and spools through collector outages of minutes, so 10 minutes of silence means "
        "the training process hung, died or lost its network.",
    )


class Finding(RuleSettings):
    """Rules raised by the agent's one-off findings: on, or off."""
