"""Early-warning rules: precursors that come before the spike, the NaN or the collapse, and
the lead time each warning had, recorded on it once the event happens (issue 32).

- `update_rms_rise` (warning): Adam's second-moment lag, `adam_rms_max` (the agent reads
  it from the optimizer every `EVERY` (4) steps, `agent/precursors.py`), leaves its own rolling median:
  the gradients outgrow what the optimizer has seen. Wortsman et al. 2023 (arXiv
  2304.13013): loss spikes follow 1-8 steps later.
- `scale_decline` (warning): the loss scale fell by 2^`min_octaves` within `window_steps`
  in at least `min_falls` separate halvings and did not grow at all in that window, judged
  at each fall, warm-up calibration excepted. The public incident behind it fell 64 -> 4 over 200 steps before its NaN,
  never below 1 and never by 2^8 within the collapse window, so loss_scale_collapse
  said nothing.
- `flush_trend` (warning, per layer): a layer's share of |g*S| below 2^-24 (what the agent
  forecasts would flush to zero in FP16) rises from sample to sample above `min_flush`,
  before the layer is mostly zero (silent_underflow fired 30 steps after the first
  layer was >= 95% zero on a gradual-underflow training).
- Escalation: a precursor that holds while the grad norm is `escalate_ratio` times its
  own rolling median becomes critical.

Lead time: a precursor alert that fired keeps its step here (`PrecursorState.awaiting`);
once the first event alert (`EVENT_RULES`) of the run with its onset at or after it has
fired, the precursor alerts' `values` get `event_rule`, `event_step` (the event's onset)
and `lead_steps` (event step - the precursor's fired step), once (`stamp_leads`, after the
batch's transitions are written; a pending event may still be dropped, so it waits).

State: one dataclass under the engine's ``precursors`` key, bounded (rings of
`baseline_samples` values, the window's falls, one number per layer for the flush trend).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import decode_float
from ampwatch.server import run_version
from ampwatch.server.alerts.json_copy import json_copy
from ampwatch.server.alerts.layer_settings import FlushTrend
from ampwatch.server.alerts.lifecycle import Tracker
from ampwatch.server.alerts.numbers import shares
from ampwatch.server.alerts.rule_settings import RuleSettings, ScaleDecline, UpdateRmsRise
from ampwatch.server.models import Alert, Run
from ampwatch.server.schemas.wire import LayerStatsIn, StepIn

PRECURSOR_RULES = ("update_rms_rise", "scale_decline", "flush_trend")
#: The alerts that mark the event a precursor warned of.
EVENT_RULES = (
    "nan_loss", "loss_spike", "loss_scale_collapse", "silent_underflow", "overflow_burst",
    "scale_floor_stall",
)  # fmt: skip


@dataclass
class PrecursorState:
    """What the precursor rules remember between batches (module docstring)."""

    rms: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    #: (step, octaves) of the loss scale's falls within `scale_decline.window_steps`.
    falls: list[list[float]] = field(default_factory=list)
    scale: float | None = None
    #: The step the loss scale last grew.
    grown: int | None = None
    #: The last flush fraction sampled per layer.
    flush: dict[str, float] = field(default_factory=dict)
    #: Fired step of the earliest precursor alert still waiting for its event's step.
    awaiting: int | None = None
    #: "rule|layer" -> the lead stamped on its open alert: merged into any message the
    #: alert renders later (an escalation, a resolution), so the lead is never lost.
    leads: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> PrecursorState:
        data = data or {}
        return cls(rms=list(data.get("rms", [])), norms=list(data.get("norms", [])),
                   falls=[list(f) for f in data.get("falls", [])], scale=data.get("scale"),
                   grown=data.get("grown"), leads=dict(data.get("leads", {})),
                   flush=dict(data.get("flush", {})), awaiting=data.get("awaiting"))  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return json_copy(self)  # type: ignore[no-any-return]


def _median(ring: list[float]) -> float | None:
    return statistics.median(ring) if ring else None


def _warn(tracker: Tracker, state: PrecursorState, rule: str, step: int,
          message: str, values: dict[str, Any], *, critical: bool, layer: str = "") -> None:  # fmt: skip
    open_alert = tracker.open.get((rule, layer))
    unchanged = open_alert is not None and (not critical or open_alert.severity == "critical")
    if unchanged and tracker.still_firing(rule, layer):
        return  # firing already: its message and values stay as they are
    key = f"{rule}|{layer}"
    if open_alert is None:
        state.leads.pop(key, None)  # a new alert: an old one's lead is not its own
    severity: Any = "critical" if critical else None

    def detail() -> tuple[str, dict[str, Any]]:
        return message, {**values, **state.leads.get(key, {})}

    tracker.holds(rule, step, detail, layer=layer, severity=severity)
    if state.awaiting is None:
        state.awaiting = step


def _norm_rises(state: PrecursorState, rule: UpdateRmsRise) -> tuple[bool, float | None]:
    """Is the last grad norm `escalate_ratio` x the median of the ones before it? Asked only
    by a precursor that fires (the median's sort, at every step, was a tenth of the step
    rules' cost)."""
    if len(state.norms) < rule.min_baseline_samples + 1:
        return False, None
    median = _median(state.norms[:-1])
    last = state.norms[-1]
    return bool(median and median > 0 and last >= rule.escalate_ratio * median), median


def judge_step(
    tracker: Tracker,
    state: PrecursorState,
    record: StepIn,
    *,
    calibrating: bool,
    settings: dict[str, RuleSettings],
) -> None:
    """Judge one step of the followed rank (after the engine's own rules)."""
    rms_rule = settings["update_rms_rise"]
    decline = settings["scale_decline"]
    assert isinstance(rms_rule, UpdateRmsRise) and isinstance(decline, ScaleDecline)
    s = record.step
    norm = None if record.grad_norm is None else decode_float(record.grad_norm)
    if not record.skipped and norm is not None and math.isfinite(norm):
        state.norms.append(norm)
        del state.norms[: -rms_rule.baseline_samples - 1]
    if rms_rule.enabled:
        _update_rms(tracker, state, record, rms_rule, calibrating)
    scale = None if record.loss_scale is None else decode_float(record.loss_scale)
    if decline.enabled and scale is not None and math.isfinite(scale) and scale > 0:
        _scale_decline(tracker, state, s, scale, decline, calibrating, rms_rule)


def _update_rms(
    tracker: Tracker, state: PrecursorState, record: StepIn, rule: UpdateRmsRise,
    calibrating: bool,
) -> None:  # fmt: skip
    s = record.step
    value = None if record.adam_rms_max is None else decode_float(record.adam_rms_max)
    if record.skipped or value is None or not math.isfinite(value):
        return  # a skipped step left the moments alone; its gradients are Inf/NaN
    median = _median(state.rms) if len(state.rms) >= rule.min_baseline_samples else None
    state.rms = [*state.rms, value][-rule.baseline_samples :]
    if median is None or calibrating:
        return
    if value >= rule.min_ratio * median and value >= rule.min_value:
        rising, norm_median = _norm_rises(state, rule)
        message = (f"Adam's second moment lags the gradients: update RMS {value:.3g} at step "
                   f"{s}, {value / median:.2g}x its median {median:.3g}")  # fmt: skip
        values: dict[str, Any] = {"adam_rms_max": value, "median": median, "step": s}
        if rising and norm_median is not None:
            message += f", with the grad norm {state.norms[-1]:.3g} (median {norm_median:.3g})"
            values["grad_norm_median"] = norm_median
        _warn(tracker, state, "update_rms_rise", s, message, values, critical=rising)
    else:
        tracker.clear("update_rms_rise", s)


def _scale_decline(
    tracker: Tracker, state: PrecursorState, s: int, scale: float, rule: ScaleDecline,
    calibrating: bool, rms_rule: UpdateRmsRise,
) -> None:  # fmt: skip
    previous, state.scale = state.scale, scale
    if calibrating:
        state.falls = []
        return
    fell = previous is not None and scale < previous
    if previous is not None and scale > previous:
        state.grown = s
    elif fell:
        assert previous is not None
        state.falls.append([s, math.log2(previous) - math.log2(scale)])
    state.falls = [f for f in state.falls if f[0] > s - rule.window_steps]
    octaves = sum(f[1] for f in state.falls)
    # A scaler that grew within the window is cycling (grow, overflow, back off: healthy
    # DeepSpeed-Chat fell 512 -> 8 in 6 falls over 83 steps, then grew every 100 steps).
    grew = state.grown is not None and state.grown > s - rule.window_steps
    # Judged as the scale falls: a decline that has stopped falling is not one any more.
    if fell and not grew and len(state.falls) >= rule.min_falls and octaves >= rule.min_octaves:
        first = int(state.falls[0][0])
        message = (f"the loss scale declined {2.0**octaves:.3g}x in {len(state.falls)} falls "
                   f"over steps {first}-{s} without growing back (now {scale:.4g})")  # fmt: skip
        values = {"octaves": octaves, "falls": len(state.falls), "from_step": first,
                  "loss_scale": scale}  # fmt: skip
        rising = rms_rule.enabled and _norm_rises(state, rms_rule)[0]
        _warn(tracker, state, "scale_decline", s, message, values, critical=rising)
    elif grew or not state.falls:  # the scaler grows again: the decline is over
        tracker.clear("scale_decline", s)


def judge_flush(
    tracker: Tracker,
    state: PrecursorState,
    record: LayerStatsIn,
    flush: np.ndarray,
    fresh: np.ndarray,
    rule: FlushTrend,
) -> None:
    """A layer's flush share rising from its previous sample, above `min_flush`; below it,
    the layer is clear. Every measured layer's share is kept for its next sample; only the
    layers at or above `min_flush` are looked at one by one, and the clear ones are told to
    their open alerts alone (`Tracker.clear_layers`): a loop over every layer of a
    500-layer sample was a fifth of `bench/ingest.py`'s layer-heavy batch."""
    s = record.step
    measured = np.flatnonzero(fresh & shares(flush)).tolist()
    names = [record.names[j] for j in measured]
    values = flush[measured]
    known = state.flush
    high = values >= rule.min_flush
    rising = [(k, known.get(names[k])) for k in np.flatnonzero(high).tolist()]
    # A layer is clear below `min_flush` once it has a previous sample; looked up only
    # while the rule has open alerts, the only ones a clear layer can move.
    clear = None
    if tracker.open_layers("flush_trend"):
        clear = ~high & np.array([name in known for name in names], dtype=bool)
    known.update(zip(names, values.tolist()))
    for k, previous in rising:
        name, value = names[k], float(values[k])
        if previous is not None and value - previous >= rule.min_rise:
            message = (f"layer {name}: the share of its scaled gradients that would flush to "
                       f"zero in FP16 rose {previous:.1%} -> {value:.1%} by step {s}")  # fmt: skip
            found = {"flush_fraction": value, "previous": previous, "step": s}
            _warn(tracker, state, "flush_trend", s, message, found, critical=False, layer=name)
    if clear is not None:
        tracker.clear_layers("flush_trend", s, names, clear)


def stamp_leads(session: Session, run: Run, state: PrecursorState) -> None:
    """Record on each precursor alert that fired before an event alert how many steps ahead
    of that event it was (module docstring), event by event from `state.awaiting` on.

    Judged only on what no later batch can change, so that where a run's steps are cut
    into batches never changes a lead: an event counts once it has fired (a pending one
    may be dropped), and not while an earlier-starting event is still pending (it may
    fire yet, and would be the first)."""
    run_id = run.id
    while state.awaiting is not None:
        after = (Alert.run_id == run_id, Alert.rule.in_(EVENT_RULES),
                 Alert.started_step >= state.awaiting)  # fmt: skip
        event = session.scalars(
            select(Alert).where(*after, Alert.fired_step.is_not(None))
            .order_by(Alert.started_step, Alert.id).limit(1)
        ).first()  # fmt: skip
        if event is None:
            return
        undecided = session.scalars(
            select(Alert.id).where(*after, Alert.status == "pending",
                                   Alert.started_step < event.started_step).limit(1)
        ).first()  # fmt: skip
        if undecided is not None:
            return
        if _stamp(session, run_id, state, event, since=state.awaiting):
            run_version.bump_alerts(session, run)
        state.awaiting = session.scalars(
            select(func.min(Alert.fired_step)).where(
                Alert.run_id == run_id, Alert.rule.in_(PRECURSOR_RULES),
                Alert.fired_step > event.started_step)
        ).first()  # fmt: skip


def _stamp(
    session: Session, run_id: int, state: PrecursorState, event: Alert, *, since: int
) -> bool:
    """The lead to `event` on each precursor alert fired from `since` up to its onset;
    whether it stamped any."""
    waiting = session.scalars(
        select(Alert).where(Alert.run_id == run_id, Alert.rule.in_(PRECURSOR_RULES),
                            Alert.fired_step >= since,
                            Alert.fired_step <= event.started_step)
    ).all()  # fmt: skip
    stamped = False
    for alert in waiting:
        if "lead_steps" in (alert.values or {}):
            continue
        assert alert.fired_step is not None
        lead = {"event_rule": event.rule, "event_step": event.started_step,
                "lead_steps": event.started_step - alert.fired_step}  # fmt: skip
        alert.values = {**(alert.values or {}), **lead}
        stamped = True
        if alert.status != "resolved":
            state.leads[f"{alert.rule}|{alert.layer}"] = lead
    return stamped
