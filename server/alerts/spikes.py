"""The scalar rules that read a short recent past: loss and grad-norm spikes, overflow bursts,
and whether a low loss scale is still falling.

Why these exist (issue #13, replaying public training logs): real divergences show in the
loss or the grad norm before, or without, any change of the loss scale (BigScience
tr8-104B: the loss x1.8 at a constant scale, NaN later); a burst of skips is a storm at any
absolute scale (tr8b-104B: 6 of 7 steps skipped at 2^20 after a resume, then NaN), which a
500-step skip rate averages away; and a scale below 1.0 is a collapse only while it falls
(a fairseq run sits at 0.5 for thousands of steps, healthy).

The state is one dataclass, `RecentState`, serialised in one place (`from_json` /
`to_json`) under the ``recent`` key of the engine's ``steps`` state. It is bounded whatever
the run's length: each baseline holds at most its rule's `baseline_samples` values, the
window at most `window_width` steps.

>>> state = RecentState.from_json(None)
>>> state.observe(10, 4096.0, False, width=50)
>>> state.fall_octaves(11, 1024.0, width=50)
2.0
"""

from __future__ import annotations

import bisect
import math
import operator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ampwatch.server.alerts.json_copy import json_copy
from ampwatch.server.alerts.lifecycle import Detail, Tracker
from ampwatch.server.alerts.numbers import ratio, times
from ampwatch.server.alerts.rule_settings import (
    GradNormSpike,
    LossScaleCollapse,
    LossSpike,
    OverflowBurst,
    RuleSettings,
)
from ampwatch.server.baselines import Baseline, remember, rolling_baselines


@dataclass
class RecentState:
    """Recent finite losses and grad norms (the spike baselines), and the last steps'
    (step, loss scale, skipped) for the burst and trend tests."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    window: list[list[Any]] = field(default_factory=list)
    #: The step of the last learned loss: the next logged loss stands for the steps since
    #: (loss_spike's onset, `covered_from`).
    loss_step: int | None = None
    #: The step of the last grad norm judged (or learned): a sharded norm completed later
    #: is judged only past it, so the baseline learns in step order (`judge_late_norms`).
    norm_step: int | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> RecentState:
        data = data or {}
        return cls(losses=list(data.get("losses", [])), grad_norms=list(data.get("grad_norms", [])),
                   window=[list(w) for w in data.get("window", [])],
                   loss_step=data.get("loss_step"), norm_step=data.get("norm_step"))  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return json_copy(self)  # type: ignore[no-any-return]

    def observe(self, step: int, scale: float | None, skipped: bool, *, width: int) -> None:
        """Add a step to the window and drop the steps older than `width`."""
        self.window.append([step, scale, bool(skipped)])
        cut = 0
        while cut < len(self.window) and self.window[cut][0] <= step - width:
            cut += 1
        if cut:
            del self.window[:cut]

    def skipped_within(self, step: int, width: int, *, max_scale: float | None = None) -> list[int]:
        """Skipped steps in (step - width, step], optionally only those at scale <= max_scale.
        The window is in step order: only its last steps are read (overflow_burst asks for
        8 of its 50 at every step)."""
        start = bisect.bisect_right(self.window, step - width, key=_step_of)
        skips = filter(_skipped_of, self.window[start:])  # (the few skips, found without a loop)
        return [s for s, scale, _ in skips
                if max_scale is None or (scale is not None and scale <= max_scale)]  # fmt: skip

    def skipped_run(self, step: int, width: int) -> list[int]:
        """The skipped steps in (step - width, step] after its last applied step: the
        overflows that the scaler's halvings have not yet cured."""
        run: list[int] = []
        for s, _, skipped in reversed(self.window):
            if s <= step - width or not skipped:
                break
            run.append(s)
        return run[::-1]

    def fall_octaves(self, step: int, scale: float, width: int) -> float:
        """Halvings from the highest scale of the last `width` steps down to `scale`. Asked
        at every step while a scale sits below min_scale: the window's steps are found by
        bisection and its scales read without a Python loop."""
        if scale <= 0:
            return 128.0
        start = bisect.bisect_right(self.window, step - width, key=_step_of)
        try:
            peak = max(map(_scale_of, self.window[start:]), default=scale)
        except TypeError:  # a step without a scale (None) among them
            peak = max((v for _, v, _ in self.window[start:] if v is not None), default=scale)
        if peak is None:  # (`max` of the one step, without a scale)
            peak = scale
        return max(0.0, math.log2(peak) - math.log2(scale))  # a quotient could overflow


_step_of = operator.itemgetter(0)
_scale_of = operator.itemgetter(1)
_skipped_of = operator.itemgetter(2)


def still_falling(state: RecentState, step: int, scale: float, rule: LossScaleCollapse) -> bool:
    """A low scale is a collapse while it falls: 2^trend_octaves within trend_steps, or
    trend_skips skipped steps at or below min_scale there."""
    if state.fall_octaves(step, scale, rule.trend_steps) >= rule.trend_octaves:
        return True
    low_skips = state.skipped_within(step, rule.trend_steps, max_scale=rule.min_scale)
    return bool(len(low_skips) >= rule.trend_skips)


def window_width(settings: dict[str, RuleSettings]) -> int:
    collapse = settings["loss_scale_collapse"]
    burst = settings["overflow_burst"]
    assert isinstance(collapse, LossScaleCollapse) and isinstance(burst, OverflowBurst)
    return int(max(collapse.trend_steps, burst.window_steps))


class Spike(NamedTuple):
    """A value judged against the median of its baseline (a tuple: one is built per judged
    value, and a frozen dataclass's construction was a tenth of the spike rules' cost)."""

    value: float
    median: float
    mad: float  # scaled (1.4826 x MAD); 0 for a flat or short baseline
    samples: int

    @property
    def ratio(self) -> float | None:
        return ratio(self.value, self.median)

    @property
    def z(self) -> float | None:
        return (self.value - self.median) / self.mad if self.mad > 0 else None


def judge_spike(
    baseline: Baseline | None,
    value: float,
    *,
    min_ratio: float,
    min_increase: float,
    z_threshold: float,
    z_min_samples: int,
) -> tuple[bool | None, Spike | None]:
    """(spiking, the judgement); (None, None) while the baseline is too short (None).

    Every test that says something must pass, and at least one must say something: a
    multiple of the median says nothing when the median is not positive (any value is
    "x times 0"; a grad norm of 0 at a zero median fired as "infx" its median), so at
    such a median a spike needs `min_increase` > 0 or the robust z to speak.
    """
    if baseline is None:
        return None, None
    median, mad, samples = baseline
    spike = Spike(value, median, mad, samples)
    with_z = samples >= z_min_samples and mad > 0
    spiking = (
        value >= min_ratio * median
        and value - median >= min_increase
        and (median > 0 or min_increase > 0 or with_z)
    )
    if spiking and with_z:
        spiking = (value - median) / mad >= z_threshold
    return spiking, spike


def learned(value: float | None, skipped: bool) -> float | None:
    """The value of a step that loss_spike and grad_norm_spike judge and learn: an applied
    step's finite one. A non-finite loss is nan_loss's; a skipped step did not train the
    model (a corrupted batch's huge loss overflowing its gradients is one skip the scaler
    handles, and a storm of them is overflow_burst's), and its grad norm is Inf/NaN or a
    stale repeat."""
    return value if value is not None and not skipped and math.isfinite(value) else None


def baselines(
    ring: list[float], values: list[float | None], rule: LossSpike | GradNormSpike
) -> list[Baseline | None]:
    """Each step's baseline for `rule`, from its `learned` values (`rolling_baselines`)."""
    return rolling_baselines(ring, values, rule.baseline_samples, rule.min_baseline_samples)


def covered_from(previous: int | None, s: int) -> int:
    """The first step a value logged at `s` stands for: the step after the previous logged
    one (a log prints every k steps; Megatron's lm loss is the interval's mean), or `s`
    itself for the first."""
    return s if previous is None or previous >= s else previous + 1


def judge(
    tracker: Tracker, name: str, what: str, s: int, value: float, baseline: Baseline | None,
    rule: LossSpike | GradNormSpike, *, onset: int | None = None,
) -> None:  # fmt: skip
    """Judge step `s`'s learned `value` (loss_spike: "loss"; grad_norm_spike: "global grad
    norm") against its baseline. `onset`: the first step the value stands for; the alert
    fires once the spike has covered the rule's `for_steps` from there."""
    spiking, spike = judge_spike(baseline, value, min_ratio=rule.min_ratio,
                                 min_increase=rule.min_increase, z_threshold=rule.z_threshold,
                                 z_min_samples=rule.z_min_samples)  # fmt: skip
    if spiking and spike is not None:
        tracker.holds(name, s, _detail(what, s, spike), onset=onset)
    elif spiking is not None:
        tracker.clear(name, s)


#: A sharded step's grad norm that a later batch completed: (rank, step, norm, skipped).
LateNorm = tuple[int, int, float, bool]


def judge_late_norms(
    tracker: Tracker, state: RecentState, late: list[LateNorm], rank: int | None,
    rule: GradNormSpike, *, calibrating: bool,
) -> None:  # fmt: skip
    """Judge and learn the followed `rank`'s grad norms that ingest combined after the
    engine had read their steps (the last part of a sharded step came with another rank's
    later batch, `ampwatch.server.ingest`), in step order, as `_evaluate_steps` judges a
    norm its record carried. Only steps past the last judged norm (`norm_step`): a
    baseline learns in step order, so a norm completed after later ones were judged is
    stored but not judged. Calibration is the run's as of this batch."""
    fresh = sorted((s, n, k) for r, s, n, k in late
                   if r == rank and (state.norm_step is None or s > state.norm_step))  # fmt: skip
    if not rule.enabled or not fresh:
        return
    values = [learned(norm, skipped) for _, norm, skipped in fresh]
    for (s, _, _), value, baseline in zip(fresh, values, baselines(state.grad_norms, values, rule)):
        if value is not None and not calibrating:
            judge(tracker, "grad_norm_spike", "global grad norm", s, value, baseline, rule)
    state.grad_norms = remember(state.grad_norms, values, rule.baseline_samples)
    state.norm_step = fresh[-1][0]


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _detail(what: str, s: int, spike: Spike) -> Detail:
    def detail() -> tuple[str, dict[str, Any]]:
        z = spike.z
        above = (times(spike.value, spike.median) if spike.median > 0
                 else f"{_fmt(spike.value - spike.median)} above")  # fmt: skip
        message = (f"{what} {_fmt(spike.value)} at step {s} is {above} its rolling "
                   f"median {_fmt(spike.median)} over {spike.samples} values"
                   + (f" (robust z {z:.0f})" if z is not None else ""))  # fmt: skip
        return message, {"value": spike.value, "baseline_median": spike.median,
                         "baseline_mad": spike.mad, "baseline_samples": spike.samples,
                         "ratio": spike.ratio, "robust_z": z, "step": s}  # fmt: skip

    return detail


def overflow_burst(
    tracker: Any, state: RecentState, s: int, scale: float | None, rule: OverflowBurst
) -> None:
    """After calibration: min_skips skipped steps in a row within window_steps fire, at any
    scale; an open burst then counts every skip in the window (its extent). An applied step
    between two overflows shows that one halving cured the first (DeepSpeed-Chat's healthy
    reward-model run skips 483, 486 and 487, then finishes); a run of them shows the
    gradients outgrowing each halving (tr8b-104B, chinese-llama)."""
    run = state.skipped_run(s, rule.window_steps)
    if not tracker.is_open("overflow_burst") and len(run) < rule.min_skips:
        skips = []  # not yet a storm: the skips so far were each cured by a halving
    else:  # (counted only then: every step of a run asked for it, a tenth of its judging)
        skips = state.skipped_within(s, rule.window_steps)
    if len(skips) < rule.min_skips:
        tracker.clear("overflow_burst", s)
        return
    count, first = len(skips), skips[0]

    def detail() -> tuple[str, dict[str, Any]]:
        return (
            (f"{count} of the {s - first + 1} steps {first}-{s} were skipped (overflow) at loss "
            f"scale {_fmt(scale) if scale is not None else 'unknown'}: an overflow storm, not "
            "the single skip a healthy scaler makes per overflow"),
            {"skipped": count, "first_skip_step": first, "step": s, "loss_scale": scale,
             "window_steps": rule.window_steps},
        )  # fmt: skip

    tracker.holds("overflow_burst", s, detail, onset=first)
