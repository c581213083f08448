"""The alert rules: name, severity, scope and description, in one place; each rule's
thresholds are its settings model (`rule_settings`, `layer_settings`).

>>> settings_model("skip_rate")(max_fraction=0.1).window_steps
500
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ampwatch.server.alerts.layer_settings import (
    FlushTrend,
    Fp8Risk,
    SilentUnderflow,
    UnderflowRisk,
)
from ampwatch.server.alerts.rule_settings import (
    ActivationNormSpike,
    Finding,
    GradNormSpike,
    LossCollapse,
    LossScaleCollapse,
    LossSpike,
    NanLoss,
    NoData,
    OverflowBurst,
    RuleSettings,
    ScaleDecline,
    ScaleFloorStall,
    SkipRate,
    UpdateRmsRise,
)
from ampwatch.server.models import Severity

RuleScope = Literal["run", "layer"]
#: Every rule's name, for typed query parameters (checked against `RULES` below).
RuleName = Literal[
    "loss_scale_collapse", "skip_rate", "activation_norm_spike", "silent_underflow",
    "underflow_risk", "scale_floor_stall", "no_data", "nan_loss", "fp16_without_scaler",
    "clip_before_unscale", "loss_spike", "grad_norm_spike", "overflow_burst", "fp8_risk",
    "update_rms_rise", "scale_decline", "flush_trend",
    "loss_collapse",
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
            "The dynamic loss scale fell below min_scale (or skips at it) while still falling, "
            "skipped below 2^floor_headroom_octaves times the scaler's floor the run reported, "
            "fell by 2^fall_octaves within window_steps without recovering, "
            "or max_consecutive_skips steps in a row were skipped (warm-up calibration "
            "excepted).",
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
            "current loss scale, or sits in FP16's subnormal range (the forecast of a drift).",
        ),
        Rule(
            "scale_floor_stall", "critical", "run", ScaleFloorStall,
            "Every step of a window was skipped while the loss scale sat unchanged at a "
            "floor (at once at the scaler's floor the run reported; without one, after "
            "floor_skips at a scale <= floor_max_scale: 'reducing 1 to 1'): the process runs "
            "but training has stopped.",
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
        Rule(
            "loss_spike", "warning", "run", LossSpike,
            "The loss of an applied (not skipped) step jumped far above its own rolling "
            "median (min_ratio and min_increase, and a robust z once the baseline is long), at "
            "any loss scale: divergences show in the loss before, or without, any change of "
            "the scale. Warm-up calibration excepted.",
        ),
        Rule(
            "grad_norm_spike", "warning", "run", GradNormSpike,
            "The global gradient norm of an applied step is min_ratio times its own rolling "
            "median or more: the spike that comes before a loss spike.",
        ),
        Rule(
            "loss_collapse", "warning", "run", LossCollapse,
            "The loss, or the global grad norm of an applied step, fell to 10^-orders times "
            "its rolling median or below (0 included) in one log interval and stays there: "
            "the run no longer learns (OLMo #692: cross-entropy 12.18 -> 0.0). Critical when "
            "both collapsed.",
        ),
        Rule(
            "overflow_burst", "critical", "run", OverflowBurst,
            "min_skips steps skipped within window_steps after warm-up calibration, at any "
            "scale: an overflow storm (a resumed process's included).",
        ),
        Rule(
            "fp8_risk", "warning", "layer", Fp8Risk,
            "Under the FP8 recipe the run declares (watch(fp8_recipe=...)), a share of a "
            "layer's weight, gradient or input activation would flush, saturate or lose "
            "precision beyond its limit (the FP8 readiness view's 'does not fit'). Runs that "
            "declare no recipe are not judged.",
        ),
        Rule(
            "update_rms_rise", "warning", "run", UpdateRmsRise,
            "Adam's update RMS (adam_rms_max: sqrt(mean(g^2 / v_hat)), the maximum over "
            "layers) left its own rolling median: the second moment lags the gradients, "
            "1-8 steps before loss spikes (Wortsman et al. 2023). Critical with a grad-norm "
            "rise at the same step.",
        ),
        Rule(
            "scale_decline", "warning", "run", ScaleDecline,
            "The loss scale declined by 2^min_octaves within window_steps in min_falls "
            "separate falls without growing back, warm-up calibration excepted: the slow "
            "slide loss_scale_collapse does not see. Critical with a grad-norm rise.",
        ),
        Rule(
            "flush_trend", "warning", "layer", FlushTrend,
            "A layer's share of scaled gradients that would flush to zero in FP16 rises "
            "from sample to sample above min_flush: warned before the layer freezes.",
        ),
    )
}  # fmt: skip

#: Agent finding codes (a `finding` event's `code`) that raise a rule. `bf16_in_use` and
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
