"""`activation_norm_spike`: the final layer's activation norm against its own robust rolling
baseline (median and MAD of the last `baseline_steps` finite norms, computed per step and
vectorised over a batch), escalated to critical when the loss scale falls with it (the
OPT-175B divergence signature).

What it judged is stored with each step (`Step.act_threshold`, `act_above`: the engine
returns it, ingest writes it), and that is the line the activation-norm chart draws: the
chart cannot disagree with the rule, and no second baseline exists to drift from it.

>>> firing_threshold(10.0, 1.0, ActivationNormSpike())  # 2 x 10 > 10 + 10 x 1
20.0
"""

from __future__ import annotations

import functools
import math
from typing import Any

from ampwatch.agent.wire import WireFloat, decode_float
from ampwatch.server.alerts.lifecycle import Detail, Tracker
from ampwatch.server.alerts.numbers import fmt, times
from ampwatch.server.alerts.rule_settings import ActivationNormSpike
from ampwatch.server.alerts.state import StepState
from ampwatch.server.baselines import Baseline
from ampwatch.server.models import Severity
from ampwatch.server.schemas.wire import StepIn


def judged_fields(rule: ActivationNormSpike) -> tuple[str, ...]:
    """The step fields the rule judges, first reported first: before the final norm when
    the agent measured it (the norm holds a divergence down after it: on the lr blow-up
    scenario the value before it reached x2 its median 9 steps earlier), the signal before
    the other statistic. An agent measures the pre-norm value on every step or on none, so
    one run's baseline is never a mix.

    >>> judged_fields(ActivationNormSpike())[0]
    'act_prenorm_mean'
    """
    return _fields_of(rule.signal)


@functools.cache
def _fields_of(signal: str) -> tuple[str, ...]:
    """`judged_fields` of a signal, built once (it was asked for at every step)."""
    other = "act_norm_max" if signal == "act_norm_mean" else "act_norm_mean"
    names = (signal, other)
    return (*(n.replace("act_norm", "act_prenorm") for n in names), *names)


def act_value(record: StepIn, rule: ActivationNormSpike) -> float | None:
    """The step's norm to judge (`judged_fields`)."""
    for name in judged_fields(rule):
        raw: WireFloat | None = getattr(record, name)
        if raw is not None:
            value: float | None = decode_float(raw)
            return value
    return None


def firing_threshold(median: float, mad: float, rule: ActivationNormSpike) -> float:
    """The value above which a step spikes against a baseline of (`median`, scaled `mad`):
    at least min_ratio x the median and, with a spread, more than z_threshold robust
    deviations above it (`activation_spike`'s test, as one number to draw)."""
    ratio = rule.min_ratio * median
    return ratio if mad == 0 else max(ratio, median + rule.z_threshold * mad)


def _scale_falling(d: StepState, s: int, rule: ActivationNormSpike) -> bool:
    """The loss scale fell by 2^scale_fall_octaves within the last scale_fall_window steps."""
    octaves = sum(o for step, o in d.falls if s - step <= rule.scale_fall_window)
    return bool(octaves >= rule.scale_fall_octaves)


def activation_spike(
    tracker: Tracker,
    d: StepState,
    s: int,
    value: float,
    baseline: Baseline | None,
    rule: ActivationNormSpike,
) -> tuple[float, bool] | None:
    """Judge step `s`'s `value`; returns (its firing threshold, spiking) when it judged."""
    falling = _scale_falling(d, s, rule)
    # The scale falls just after a spike: the same incident, now the OPT-175B signature.
    recent_spike = d.last_spike is not None and s - d.last_spike <= rule.scale_fall_window
    if (d.last_fall == s and falling and recent_spike
            and tracker.is_open("activation_norm_spike")):  # fmt: skip
        tracker.holds("activation_norm_spike", s, _escalated(d), severity="critical")
    # A non-finite norm is a NaN/Inf forward pass: nan_loss's (or the skip's) business,
    # not a spike; it neither holds nor clears this rule.
    if baseline is None or d.calibrating or not math.isfinite(value):
        return None
    median, mad, _ = baseline
    if median <= 0 and mad == 0:  # no test says anything: any value is "x times 0"
        tracker.clear("activation_norm_spike", s)
        return None  # and no value would fire: no threshold to draw
    threshold = firing_threshold(median, mad, rule)
    spiking = value >= rule.min_ratio * median and (
        mad == 0 or (value - median) / mad > rule.z_threshold
    )
    if not spiking:
        tracker.clear("activation_norm_spike", s)
        return threshold, False
    d.last_spike = s
    d.last_spike_value = value
    z = (value - median) / mad if mad > 0 else None
    severity: Severity = "critical" if falling else "warning"
    scale, last_fall = d.scale, d.last_fall

    def detail() -> tuple[str, dict[str, Any]]:
        above = times(value, median) if median > 0 else f"{fmt(value - median)} above"
        message = (
            f"final-layer activation norm {fmt(value)} at step {s} is {above} its rolling "
            f"median {fmt(median)}" + (f" (robust z {z:.0f})" if z is not None else "")
        )
        if falling:
            message += (f" while the loss scale is falling (to {fmt(scale)} at step "
                        f"{last_fall}): the OPT-175B divergence signature")  # fmt: skip
        return message, {
            "act_norm": value,
            "baseline_median": median, "baseline_mad": mad, "robust_z": z, "step": s,
            "signal": rule.signal, "loss_scale": scale, "scale_fall_step": last_fall,
        }  # fmt: skip

    tracker.holds("activation_norm_spike", s, detail, severity=severity)
    return threshold, True


def _escalated(d: StepState) -> Detail:
    """The escalation's message, of the state now: rendered at the batch's end, by when
    the scale may have fallen again, out of the spike's window (a batch boundary must not
    change what the alert says)."""
    value, spike, fall, scale = d.last_spike_value, d.last_spike, d.last_fall, d.scale

    def detail() -> tuple[str, dict[str, Any]]:
        return (
            (
                f"final-layer activation norm spiked to {fmt(value)} at step {spike} and the loss "
                f"scale fell to {fmt(scale)} at step {fall}: the OPT-175B divergence signature"
            ),
            {"act_norm": value, "step": spike, "loss_scale": scale, "scale_fall_step": fall},
        )

    return detail
