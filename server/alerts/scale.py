"""The loss-scale rules: `loss_scale_collapse` (a low scale while falling, an unrecovered
fall of 2^k, K skips in a row), `scale_floor_stall`, `skip_rate`, and `nan_loss`'s message.
Each judges one step against the `StepState` the engine moved to it.

"Low": a scale below min_scale (DeepSpeed's and Megatron's floor, 1) while it is falling;
and, when the run reports its scaler's configured floor (`wire.MIN_LOSS_SCALE` in
run_start), a skip below 2^floor_headroom_octaves x that floor, at once, and a skip at it
is a stall at once (floor_max_scale guesses the stall's floor otherwise)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

from ampwatch.agent import wire
from ampwatch.server.alerts.lifecycle import Tracker
from ampwatch.server.alerts.numbers import fmt, octaves
from ampwatch.server.alerts.rule_settings import LossScaleCollapse, ScaleFloorStall, SkipRate
from ampwatch.server.alerts.spikes import RecentState, still_falling
from ampwatch.server.alerts.state import StepState


def reported_floor(run_start: Mapping[str, Any]) -> float | None:
    """The scaler's configured floor a run_start reports, if it is a positive finite number.

    >>> reported_floor({"min_loss_scale": 1e-4}), reported_floor({"min_loss_scale": None})
    (0.0001, None)
    """
    floor = run_start.get(wire.MIN_LOSS_SCALE)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)):
        return None
    return float(floor) if math.isfinite(floor) and floor > 0 else None


def near_floor(d: StepState, rule: LossScaleCollapse) -> float | None:
    """The scale below which a skip threatens a run that reported its floor: that skip's
    halving and a burst of 3 more would cross the floor (2^floor_headroom_octaves x it)."""
    if d.min_loss_scale is None:
        return None
    return float(d.min_loss_scale * 2.0**rule.floor_headroom_octaves)


def track_low_scale(
    d: StepState,
    recent: RecentState,
    s: int,
    scale: float,
    skipped: bool,
    rule: LossScaleCollapse,
) -> None:
    """Move the low-scale test to step `s`: a scale near the reported floor is a collapse
    once it skips there; a scale below min_scale (or skipping at it) while it is still
    falling; then it holds until the scale is back."""
    near = near_floor(d, rule)
    at_floor = near is not None and scale < near
    guessed = scale < rule.min_scale or (scale == rule.min_scale and skipped)
    if not at_floor:
        d.near_floor_since = None
    elif d.near_floor_since is None:
        d.near_floor_since = s
    if not (at_floor or guessed):
        d.below_since = None
        d.below_falling = False
        return
    if d.below_since is None:
        d.below_since = s
    if d.below_falling:
        return
    if at_floor and skipped:  # its onset: the first step near the floor
        d.below_falling, d.below_since = True, d.near_floor_since
    elif guessed:
        d.below_falling = still_falling(recent, s, scale, rule)


def loss_scale_collapse(
    tracker: Tracker, d: StepState, s: int, scale: float | None, rule: LossScaleCollapse
) -> None:
    parts: list[str] = []
    values: dict[str, Any] = {"step": s, "loss_scale": scale}
    onsets: list[int] = []
    if d.below_since is not None and scale is not None and d.below_falling:
        onsets.append(d.below_since)
        floor, near = d.min_loss_scale, near_floor(d, rule)
        if floor is not None and near is not None and scale < near:
            parts.append(f"loss scale {fmt(scale)} is skipping {octaves(scale / floor)} above "
                         f"the scaler's floor {fmt(floor)} since step {d.below_since}: a burst "
                         "of overflows would take it below the floor")  # fmt: skip
            values.update(min_loss_scale=floor, below_since_step=d.below_since)
        else:
            where = "is below" if scale < rule.min_scale else "is skipping at"
            parts.append(f"loss scale {fmt(scale)} {where} min_scale {fmt(rule.min_scale)} "
                         f"since step {d.below_since}, falling")  # fmt: skip
            values.update(min_scale=rule.min_scale, below_since_step=d.below_since)
    if not d.calibrating:
        changes = d.changes
        if scale is not None and changes:
            peak_index = max(range(len(changes)), key=lambda i: changes[i][1])
            peak_step, peak = changes[peak_index]
            if peak > scale and (scale <= 0 or peak / scale >= 2.0**rule.fall_octaves):
                start = _fall_start(changes, peak_index, rule)
                fall_start, before = changes[start][0], changes[start - 1][1]
                onsets.append(fall_start)
                parts.insert(0, f"loss scale fell from {fmt(before)} to {fmt(scale)} "
                             f"({octaves(scale / before)}) between steps {fall_start} "
                             f"and {s}")  # fmt: skip
                values.update(
                    peak_scale=peak,
                    peak_step=peak_step,
                    fall_start_step=fall_start,
                    scale_before_fall=before,
                    fall_octaves=math.log2(peak) - math.log2(scale) if scale > 0 else None,
                )
        if d.skip_run >= rule.max_consecutive_skips and d.skip_run_start is not None:
            onsets.append(d.skip_run_start)
    # The longest run of skips of this incident stays in its message after it ended.
    if d.skip_run and (d.skip_run > d.incident_skips):
        d.incident_skips, d.incident_skips_from = d.skip_run, d.skip_run_start
    if not onsets:
        d.incident_skips, d.incident_skips_from = 0, None
        tracker.clear("loss_scale_collapse", s)
        return
    if d.incident_skips >= rule.max_consecutive_skips:
        run, since = d.incident_skips, d.incident_skips_from
        ongoing = " (ongoing)" if d.skip_run == run else ""
        parts.append(f"{run} consecutive skipped steps since step {since}{ongoing}")
        values.update(consecutive_skips=run, skips_since_step=since)
    message = "; ".join(parts)
    tracker.holds("loss_scale_collapse", s, lambda: (message, values), onset=min(onsets))


def _fall_start(changes: list[list[Any]], peak_index: int, rule: LossScaleCollapse) -> int:
    """Index of the change point where the current fall began: walking back from the last
    decrease, earlier decreases belong to it while they came at the pace the rule looks
    for (at most window_steps / fall_octaves apart); a longer plateau before a decrease
    means the scaler had settled (a healthy overflow halving), not that the fall began."""
    pace = rule.window_steps / rule.fall_octaves
    decreases = [i for i in range(peak_index + 1, len(changes))
                 if changes[i][1] < changes[i - 1][1]]  # fmt: skip
    start = decreases[-1]
    for i in reversed(decreases[:-1]):
        if changes[start][0] - changes[i][0] > pace:
            break
        start = i
    return start


def scale_floor_stall(
    tracker: Tracker,
    d: StepState,
    s: int,
    scale: float | None,
    skipped: bool,
    rule: ScaleFloorStall,
) -> None:
    if skipped and scale is not None and scale > 0:
        if d.stall_run and d.stall_scale == scale:
            d.stall_run += 1
        else:
            d.stall_run, d.stall_start, d.stall_scale = 1, s, scale
    else:
        d.stall_run, d.stall_start, d.stall_scale = 0, None, None
    if not rule.enabled:
        return
    if d.min_loss_scale is not None:  # the scaler said where its floor is
        floored = (
            d.stall_run >= 1 and d.stall_scale is not None and d.stall_scale <= d.min_loss_scale
        )
    else:
        floored = (
            d.stall_run >= rule.floor_skips
            and d.stall_scale is not None
            and d.stall_scale <= rule.floor_max_scale
        )
    if d.stall_run >= rule.window_steps or floored:
        run, start, floor = d.stall_run, d.stall_start, d.stall_scale
        tracker.holds(
            "scale_floor_stall",
            s,
            lambda: (
                (
                    f"all {run} steps from {start} to {s} were skipped with the loss scale "
                    f"pinned at {fmt(floor)}: training has stopped"
                ),
                {"floor_scale": floor, "skipped_steps": run, "first_step": start, "step": s},
            ),
            onset=start,
        )
    else:
        tracker.clear("scale_floor_stall", s)


def skip_rate(tracker: Tracker, d: StepState, s: int, skipped: bool, rule: SkipRate) -> None:
    skips: list[int] = d.skips
    if skipped:
        skips.append(s)
    first = s - rule.window_steps + 1
    if skips and skips[0] < first:  # (most steps have none to drop)
        del skips[: bisect.bisect_left(skips, first)]
    assert d.counted_from is not None  # set as calibration ends, before the first count
    counted = s - max(d.counted_from, first) + 1
    if counted < rule.min_steps:
        return
    fraction = len(skips) / counted
    if fraction > rule.max_fraction:
        count, onset = len(skips), skips[0]
        tracker.holds(
            "skip_rate",
            s,
            lambda: (
                (
                    f"{count} of the last {counted} steps (to step {s}) were skipped: "
                    f"{fraction:.2%} > {rule.max_fraction:.2%}"
                ),
                {
                    "skipped": count,
                    "steps": counted,
                    "fraction": fraction,
                    "max_fraction": rule.max_fraction,
                    "step": s,
                },
            ),
            onset=onset,
        )
    else:
        tracker.clear("skip_rate", s)


def nan_detail(s: int, loss: float, since: int) -> Any:
    def detail() -> tuple[str, dict[str, Any]]:
        return (
            (
                f"loss is {wire.encode_float(loss)} at step {s} (non-finite since step "
                f"{since}): divergence, not a gradient-only overflow"
            ),
            {"loss": loss, "step": s, "non_finite_since_step": since},
        )

    return detail
