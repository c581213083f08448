"""The loss-scale rules: `loss_scale_collapse` (below min_scale while falling, an unrecovered
fall of 2^k, K skips in a row), `scale_floor_stall`, `skip_rate`, and `nan_loss`'s message.
Each judges one step against the `StepState` the engine moved to it."""

from __future__ import annotations

import bisect
import math
from typing import Any

from ampwatch.server.alerts import rules
from ampwatch.server.alerts.lifecycle import Tracker
from ampwatch.server.alerts.numbers import fmt, octaves
from ampwatch.server.alerts.state import StepState


def loss_scale_collapse(
    tracker: Tracker, d: StepState, s: int, scale: float | None, rule: rules.LossScaleCollapse
) -> None:
    parts: list[str] = []
    values: dict[str, Any] = {"step": s, "loss_scale": scale}
    onsets: list[int] = []
    if d.below_since is not None and scale is not None and d.below_falling:
        onsets.append(d.below_since)
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
                    fall_octaves=math.log2(peak / scale) if scale > 0 else None,
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


def _fall_start(changes: list[list[Any]], peak_index: int, rule: rules.LossScaleCollapse) -> int:
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
    rule: rules.ScaleFloorStall,
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


def skip_rate(tracker: Tracker, d: StepState, s: int, skipped: bool, rule: rules.SkipRate) -> None:
    skips: list[int] = d.skips
    if skipped:
        skips.append(s)
    first = s - rule.window_steps + 1
    cut = bisect.bisect_left(skips, first)
    if cut:
        del skips[:cut]
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
                f"loss is {loss} at step {s} (non-finite since step {since}): divergence, not a "
                "gradient-only overflow"
            ),
            {"loss": str(loss), "step": s, "non_finite_since_step": since},
        )

    return detail
