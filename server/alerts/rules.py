"""The alert rules: name, severity, scope and thresholds, in one place.

Each rule's thresholds are a pydantic model whose defaults are the documented defaults
(README "Alert rules" has the table with the reason for each). Overrides from the
collector's TOML file, a project and a run are validated against the same model, so an
unknown setting or a wrong type is refused with a message that names it.

>>> settings_model("skip_rate")(max_fraction=0.1).window_steps
500
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from ampwatch.server.models import Severity

_FOR = "Steps the condition must hold (from its onset) before the alert fires."
_RESOLVE = "Steps the condition must stay clear before a firing alert resolves."


def _for_steps(default: int, description: str = _FOR) -> Any:
    return Field(default=default, ge=0, le=1_000_000, description=description)


def _resolve_steps(default: int) -> Any:
    return Field(default=default, ge=0, le=1_000_000, description=_RESOLVE)


class RuleSettings(BaseModel):
    """Settings every rule has. Strict: `"5"` is not a number, `1` is not a boolean."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Evaluate this rule at all.")


class LossScaleCollapse(RuleSettings):
    for_steps: int = _for_steps(0)
    resolve_steps: int = _resolve_steps(100)
    min_scale: float = Field(
        default=1.0,
        ge=0,
        description="Fire when the loss scale falls below this (DeepSpeed and Megatron floor "
        "at 1; OPT-175B restarted from checkpoints whose scale was still >= 1).",
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


class SkipRate(RuleSettings):
    for_steps: int = _for_steps(0)
    resolve_steps: int = _resolve_steps(100)
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


class ActivationNormSpike(RuleSettings):
    for_steps: int = _for_steps(0)
    resolve_steps: int = _resolve_steps(100)
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


class SilentUnderflow(RuleSettings):
    for_steps: int = _for_steps(
        40,
        "Steps the excess must be sustained: the 3rd consecutive sample at the agent's "
        "default of one layer sample per 20 steps (one bad sample is noise, three are a "
        "trend), and a few more samples where layers are sampled more often.",
    )
    resolve_steps: int = _resolve_steps(100)
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
    for_steps: int = _for_steps(
        40, "Steps the forecast must hold: the 3rd consecutive sample at the agent's default "
        "of one layer sample per 20 steps."
    )
    resolve_steps: int = _resolve_steps(100)
    max_flush_fraction: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="Fire when this share of a layer's gradient elements would flush "
        "to zero in FP16 (|g*S| < 2^-24): a tenth of the signal about to vanish.",
    )
    only_with_loss_scale: bool = Field(
        default=True,
        description="Judge only runs that report a loss scale (FP16 with a scaler): a "
        "BF16/FP32 run's FP16 forecast is not a risk to it.",
    )


class ScaleFloorStall(RuleSettings):
    for_steps: int = _for_steps(0)
    resolve_steps: int = _resolve_steps(10)
    window_steps: int = Field(
        default=50,
        ge=2,
        description="Fire when this many steps in a row were skipped at one unchanged scale: "
        "a scaler that halves on overflow would have fallen 2^50, so the scale sits at a "
        "floor (DeepSpeed/Megatron 1, OPT-175B run12 0.25) and training has stopped.",
    )


class NoData(RuleSettings):
    stale_seconds: float = Field(
        default=600.0,
        gt=0,
        description="Fire when a running run sent nothing for this long: the agent retries "
        "and spools through collector outages of minutes, so 10 minutes of silence means "
        "the training process hung, died or lost its network.",
    )


class NanLoss(RuleSettings):
    for_steps: int = _for_steps(0)
    resolve_steps: int = _resolve_steps(100)


class Finding(RuleSettings):
    """Rules raised by the agent's one-off findings: on, or off."""


RuleScope = Literal["run", "layer"]
#: Every rule's name, for typed query parameters (checked against `RULES` below).
RuleName = Literal[
    "loss_scale_collapse", "skip_rate", "activation_norm_spike", "silent_underflow",
    "underflow_risk", "scale_floor_stall", "no_data", "nan_loss", "fp16_without_scaler",
    "clip_before_unscale",
]  # fmt: skip


@dataclass(frozen=True)
class Rule:
    name: str
    severity: Severity
    scope: RuleScope
    settings: type[RuleSettings]
    description: str


RULES: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        Rule(
            "loss_scale_collapse", "critical", "run", LossScaleCollapse,
            "The dynamic loss scale fell below min_scale, fell by 2^fall_octaves within "
            "window_steps without recovering, or max_consecutive_skips steps in a row were "
            "skipped (warm-up calibration excepted).",
        ),
        Rule(
            "skip_rate", "warning", "run", SkipRate,
            "More than max_fraction of the last window_steps optimizer steps were skipped "
            "(overflow), warm-up calibration excepted.",
        ),
        Rule(
            "activation_norm_spike", "warning", "run", ActivationNormSpike,
            "The final layer's activation norm is far above its own robust rolling "
            "baseline; critical when the loss scale falls (2^scale_fall_octaves within "
            "scale_fall_window steps) at the same time (the OPT-175B divergence signature). "
            "A non-finite norm is nan_loss's, not a spike.",
        ),
        Rule(
            "silent_underflow", "critical", "layer", SilentUnderflow,
            "A layer's exactly-zero gradient fraction is sustained well above its own "
            "baseline, or at 100% (frozen), with no skipped step or Inf/NaN explaining it: "
            "the layer has silently stopped learning.",
        ),
        Rule(
            "underflow_risk", "warning", "layer", UnderflowRisk,
            "A large share of a layer's scaled gradients would flush to zero in FP16 at the "
            "current loss scale.",
        ),
        Rule(
            "scale_floor_stall", "critical", "run", ScaleFloorStall,
            "Every step of a window was skipped while the loss scale sat unchanged at a "
            "floor: the process runs but training has stopped.",
        ),
        Rule(
            "no_data", "warning", "run", NoData,
            "The agent stopped reporting while the run is not ended.",
        ),
        Rule(
            "nan_loss", "critical", "run", NanLoss,
            "The loss itself is NaN or infinite: divergence, as opposed to a "
            "gradient-only overflow that loss scaling handles.",
        ),
        Rule(
            "fp16_without_scaler", "critical", "run", Finding,
            "The model has FP16 parameters and no loss scaler: small gradients underflow to "
            "zero (agent finding fp16_params_without_scaler).",
        ),
        Rule(
            "clip_before_unscale", "warning", "run", Finding,
            "Gradients were clipped while still multiplied by the loss scale (clip before "
            "scaler.unscale_): the clip threshold is wrong by the scale factor.",
        ),
    )
}  # fmt: skip

#: Agent finding codes (wire FINDING_CODES) that raise a rule. `bf16_in_use` and
#: `fp8_in_use` are facts, not faults: they stay events, shown on the run page.
FINDING_RULES: dict[str, str] = {
    "fp16_params_without_scaler": "fp16_without_scaler",
    "clip_before_unscale": "clip_before_unscale",
}

#: Configuration findings: true of the whole process from its start, not incidents with an
#: onset. The restart advisor does not let them reject checkpoints (no checkpoint fixes a
#: configuration); it warns instead (`ampwatch.server.advisor`).
CONFIGURATION_RULES = frozenset(FINDING_RULES.values())

#: Rules whose new alerts are inhibited while the run's loss_scale_collapse fires.
INHIBITED_BY_COLLAPSE = frozenset({"silent_underflow", "underflow_risk"})

SEVERITY_ORDER: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}


if set(get_args(RuleName)) != set(RULES):  # pragma: no cover - a rule added to one only
    raise RuntimeError("RuleName must list exactly the rules of RULES")


def settings_model(rule: str) -> type[RuleSettings]:
    return RULES[rule].settings
