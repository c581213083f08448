"""`loss_collapse`: the loss, or the global grad norm, fell off a cliff to (almost) zero.

Why (issue 31, OLMo #692, "why CrossEntropyLoss is zero"): a run's cross-entropy went
12.18 -> 1.8e-06 -> 0.0 in two steps while its grad norm went 231.7 -> 0.0002 -> 7.7e-08.
Nothing is non-finite, the scale (if any) is calm and a spike rule looks only upwards, so
no rule said anything, yet the run learns nothing more (labels leaking into the inputs, a
loss mask that masks everything, a tokenizer that maps every token to one id).

The test, per signal (the loss, the grad norm of applied steps), against the same rolling
median loss_spike and grad_norm_spike judge against (`spikes.baselines`; one baseline per
value, not a second one to drift from it):

- a value at or below 10^-orders times the median (0 included) is a collapse when the
  value logged before it was still within 10^converging_orders of that median: a cliff,
  not a run converging there (each value a few times below the last, the median
  following it down, never 1000x below it in one interval);
- the collapse then holds while the signal stays at or below 10^-orders times the median
  it fell from (kept in the state: the rolling median learns the collapsed values, and a
  run stuck at 0 must not clear itself by dragging its own baseline down);
- a negative value, or a median at or below 0 (a PPO objective crossing 0), says nothing.

Warning when one signal collapsed; critical when both did (the loss at zero and no
gradient left: nothing is being learned). The alert's onset is the first step its first
collapsed value stands for (`spikes.covered_from`), so with the default `for_steps` of 1 a
per-step log fires at its second collapsed step and a line printed every 10 steps at once.

The state, `CollapseState` (the median it fell from, the onset, the last value per signal:
a few numbers), is serialised under the ``collapse`` key of the engine's ``steps`` state.

>>> track = Track()
>>> track.observe(1, 12.18, None, 1e-3, 0.1), track.onset
(False, None)
>>> track.observe(2, 1.8e-06, (12.18, 0.0, 1), 1e-3, 0.1), track.onset
(True, 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ampwatch.server.alerts.json_copy import json_copy
from ampwatch.server.alerts.lifecycle import Detail, Tracker
from ampwatch.server.alerts.numbers import fmt
from ampwatch.server.alerts.rule_settings import LossCollapse
from ampwatch.server.alerts.spikes import covered_from
from ampwatch.server.baselines import Baseline

RULE = "loss_collapse"


@dataclass
class Track:
    """One signal's collapse: where it began and the median it fell from (None: none
    now), and the signal's last value and step (the cliff test, the onset)."""

    onset: int | None = None
    fell_from: float | None = None
    last: float | None = None
    last_step: int | None = None

    def observe(
        self, s: int, value: float | None, baseline: Baseline | None, floor: float, near: float
    ) -> bool:
        """Judge step `s`'s learned `value` (None: not logged, skipped or non-finite: no
        change) against `floor` (10^-orders) and `near` (10^-converging_orders); True when
        the signal is collapsed after it."""
        if value is None:
            return self.onset is not None
        before, before_step = self.last, self.last_step
        self.last, self.last_step = value, s
        if self.fell_from is not None:
            if 0 <= value <= self.fell_from * floor:
                return True
            self.onset = self.fell_from = None  # back up: the collapse is over
            return False
        if baseline is None or before is None or value < 0:
            return False
        median = baseline[0]
        if median > 0 and value <= median * floor and before >= median * near:
            self.onset, self.fell_from = covered_from(before_step, s), median
            return True
        return False


@dataclass
class CollapseState:
    loss: Track = field(default_factory=Track)
    grad_norm: Track = field(default_factory=Track)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> CollapseState:
        data = data or {}
        return cls(loss=Track(**data.get("loss", {})), grad_norm=Track(**data.get("grad_norm", {})))

    def to_json(self) -> dict[str, Any]:
        return json_copy(self)  # type: ignore[no-any-return]


def judge(
    tracker: Tracker,
    state: CollapseState,
    s: int,
    loss: float | None,
    loss_baseline: Baseline | None,
    norm: float | None,
    norm_baseline: Baseline | None,
    rule: LossCollapse,
) -> None:
    """Judge step `s`'s learned loss and grad norm (either may be None) against their
    baselines, and hold or clear the run's `loss_collapse`."""
    floor, near = 10.0**-rule.orders, 10.0**-rule.converging_orders
    loss_down = state.loss.observe(s, loss, loss_baseline, floor, near)
    norm_down = state.grad_norm.observe(s, norm, norm_baseline, floor, near)
    if not (loss_down or norm_down):
        if loss is not None or norm is not None:
            tracker.clear(RULE, s)
        return
    down = [t for t in (state.loss, state.grad_norm) if t.onset is not None]
    onset = min(t.onset for t in down if t.onset is not None)
    tracker.holds(RULE, s, _detail(state, s), onset=onset,
                  severity="critical" if loss_down and norm_down else None)  # fmt: skip


def _detail(state: CollapseState, s: int) -> Detail:
    parts = [(what, track.last, track.fell_from, track.onset)
             for what, track in (("loss", state.loss), ("global grad norm", state.grad_norm))
             if track.onset is not None]  # fmt: skip

    def detail() -> tuple[str, dict[str, Any]]:
        said = " and ".join(f"the {what} fell to {fmt(value)} from its rolling median "
                            f"{fmt(median)} at step {onset}"
                            for what, value, median, onset in parts)  # fmt: skip
        message = (f"at step {s} {said}, in one log interval: a collapse, not convergence "
                   "(the run no longer learns: a leaked label, a loss mask masking "
                   "everything, ...)")  # fmt: skip
        values: dict[str, Any] = {"step": s}
        for what, value, median, onset in parts:
            key = "loss" if what == "loss" else "grad_norm"
            values.update({key: value, f"{key}_median": median, f"{key}_onset": onset})
        return message, values

    return detail
