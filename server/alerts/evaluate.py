"""Incremental evaluation of a run's alert rules, one ingested batch at a time.

`evaluate_batch` runs inside the ingest transaction, with the run row locked (which
serialises the collector's workers on the run), before the batch's rows are stored: it
reads only its own state, and returns activation_norm_spike's threshold and verdict per
judged step (`Judged`), which ingest stores in the step rows for the chart to draw. It reads the run's
`alert_state` rows, open alerts and threshold overrides (three queries), evaluates the
batch's own records against that state, and writes the state back: the cost of a batch
depends on the batch and the run's layer count, never on how long the run is.

State (JSON, one row per key):
- ``steps``: the scalar rules' `state.StepState` (one dataclass, serialised there), which
  follow one rank (the lowest rank that sent steps: the agent sends step scalars from rank
  0, and all ranks share one scaler's decisions).
- ``layers``: the per-layer rules' `layers.LayerState`, compact arrays aligned with the
  layer names: the rank whose samples a layer follows (the first to report it: under data
  parallelism every rank sees the same reduced gradients; under pipeline parallelism each
  layer has one owner), the last sampled step, the zero-fraction baseline.

The rules live by family: `scale` (collapse, floor stall, skip rate, nan_loss's message),
`activation` (activation_norm_spike), `spikes` (loss / grad-norm spikes, overflow bursts,
the falling-scale trend), `collapse` (loss_collapse: the loss or grad norm falling off a
cliff to ~0, against the spike rules' baselines), `layers` (silent_underflow, underflow_risk), `fp8` (fp8_risk,
against the recipe the run_start declares). This module applies the batch's events
(`events.apply_events`), then walks its steps in order and calls them (`_StepWalk`: the
state moved to the step, then a phase per family). A new scalar rule: a settings class in
`rule_settings.py` and its row in `rules.py`, a function in its family's module called
from its family's phase of `_StepWalk`, a README row.

Records at or before the state's last step (a retried or late batch) are ignored by the
rolling state, so they can never corrupt a window or a baseline; they are still stored.
A sharded run's grad norm is combined from every rank's part by ingest before this runs
(`ampwatch.server.ingest`): the followed rank's records carry it when their batch brings
the step's last part; a norm completed later, by another rank's batch, comes as
`late_norms` and `grad_norm_spike` judges it then (`spikes.judge_late_norms`), in step
order, unless a later step's norm was judged already.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import decode_float
from ampwatch.server.alerts import collapse as collapse_rule
from ampwatch.server.alerts import precursors, spikes
from ampwatch.server.alerts.activation import act_value, activation_spike
from ampwatch.server.alerts.config import run_settings
from ampwatch.server.alerts.events import apply_events
from ampwatch.server.alerts.layers import LayerSamples, LayerState
from ampwatch.server.alerts.lifecycle import Tracker
from ampwatch.server.alerts.numbers import finite
from ampwatch.server.alerts.rule_settings import (
    ActivationNormSpike,
    GradNormSpike,
    LossCollapse,
    LossScaleCollapse,
    LossSpike,
    NanLoss,
    OverflowBurst,
    RuleSettings,
    ScaleFloorStall,
    SkipRate,
)
from ampwatch.server.alerts.scale import (
    loss_scale_collapse,
    nan_detail,
    scale_floor_stall,
    track_low_scale,
)
from ampwatch.server.alerts.scale import skip_rate as judge_skip_rate
from ampwatch.server.alerts.state import StepState
from ampwatch.server.baselines import Baseline, remember, rolling_baselines
from ampwatch.server.models import AlertState, Run
from ampwatch.server.schemas.wire import BatchIn, StepIn

logger = logging.getLogger(__name__)
T = TypeVar("T")

STEPS_KEY = "steps"
LAYERS_KEY = "layers"
PRECURSORS_KEY = "precursors"


#: What activation_norm_spike judged in a batch: (rank, step, firing threshold, above),
#: for ingest to store with the steps (`Step.act_threshold`, `act_above`).
Judged = list[tuple[int, int, float, bool]]


def evaluate_batch(
    session: Session, run: Run, batch: BatchIn, *, now: datetime,
    late_norms: list[spikes.LateNorm] | None = None,
) -> Judged:  # fmt: skip
    """Evaluate every rule of `run` on `batch` and move its alerts;
    returns what activation_norm_spike judged, per step, for the chart to draw.
    `late_norms`: sharded grad norms the batch completed for steps stored earlier.

    Call inside the ingest transaction, with the run locked; the caller commits. Runs in a
    SAVEPOINT: should evaluation ever fail, it is logged and undone, and the batch is still
    stored -- a bug here must never make an agent retry (and then drop) its data.

    >>> evaluate_batch(session, run, batch, now=utcnow())  # doctest: +SKIP
    [(0, 61, 8.52, False), ...]
    """
    try:
        with session.begin_nested():
            return _evaluate(session, run, batch, now, late_norms or [])
    except Exception:
        logger.exception("alert evaluation of run %s failed; its batch is stored", run.id)
        return []


def _evaluate(
    session: Session, run: Run, batch: BatchIn, now: datetime, late_norms: list[spikes.LateNorm]
) -> Judged:
    settings = run_settings(session, project=run.project, run_id=run.id)
    rows = {
        row.key: row
        for row in session.scalars(select(AlertState).where(AlertState.run_id == run.id))
    }
    steps_state = StepState.from_json(rows[STEPS_KEY].data if STEPS_KEY in rows else None)
    tracker = Tracker(session, run, settings, now=now, clear_since=steps_state.clear,
                      groups=steps_state.groups)  # fmt: skip

    if tracker.is_open("no_data"):  # data arrived: the agent is reporting again
        tracker.resolve("no_data", steps_state.last_step or 0)
    recipe = steps_state.fp8_recipe
    restarted = apply_events(tracker, steps_state, batch, settings)
    layers_state = None
    if batch.layer_stats or (restarted is not None and LAYERS_KEY in rows):
        layers_state = LayerState(rows[LAYERS_KEY].data if LAYERS_KEY in rows else None)
        if restarted is not None:  # its samples start again from the resumed step
            layers_state.restart(restarted)
        if steps_state.fp8_recipe != recipe:  # fp8_risk's counts were of the old recipe
            layers_state.fp8_hits[:] = 0
    # One pass in step order: a layer sample is judged after the step records up to its
    # step and before later ones, so every rule sees the state as of its own step and the
    # alerts do not depend on how the agent cut its batches.
    early = precursors.PrecursorState.from_json(rows[PRECURSORS_KEY].data
                                                if PRECURSORS_KEY in rows else None)  # fmt: skip
    samples = LayerSamples(tracker, steps_state, layers_state, batch.layer_stats, settings)
    samples.precursors = early
    guard = RuleGuard(run.id)
    if late_norms:  # earlier steps than the batch's own: judged first
        guard("grad_norm_spike", None, spikes.judge_late_norms, tracker, steps_state.recent,
              late_norms, steps_state.rank, settings["grad_norm_spike"],
              calibrating=steps_state.calibrating)  # fmt: skip
    judged = _evaluate_steps(tracker, steps_state, batch.steps, settings, samples, guard, early)
    guard("layer rules", None, samples.judge_until, None)
    tracker.finish(steps_state.last_step)
    guard("precursor leads", None, precursors.stamp_leads, session, run, early)
    _save(session, rows, run.id, PRECURSORS_KEY, early.to_json(), now)

    _save(session, rows, run.id, STEPS_KEY, steps_state.to_json(), now)
    if layers_state is not None:
        _save(session, rows, run.id, LAYERS_KEY, layers_state.data, now)
    return judged


def _save(
    session: Session,
    rows: dict[str, AlertState],
    run_id: int,
    key: str,
    data: dict[str, Any],
    now: datetime,
) -> None:
    row = rows.get(key)
    if row is None:
        session.add(AlertState(run_id=run_id, key=key, data=data, updated_at=now))
    else:
        row.data = dict(data)  # a new object: JSON columns do not track in-place changes
        row.updated_at = now


class RuleGuard:
    """Runs one rule's judgement of one step; a rule that raises is logged and judges no
    more of this batch, while the other rules, the state and every other alert of the
    batch are kept (a failure once undid the whole batch's evaluation). Its own state may
    be half-moved: the rule resumes from it with the next batch."""

    def __init__(self, run_id: int) -> None:
        self.run_id = run_id
        self.failed: set[str] = set()

    def __call__(
        self, rule: str, step: int | None, judge: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T | None:
        if rule in self.failed:
            return None
        try:
            return judge(*args, **kwargs)
        except Exception:
            self.failed.add(rule)
            logger.exception("alert rule %s of run %s failed at step %s; the batch's other "
                             "rules go on", rule, self.run_id, step)  # fmt: skip
            return None


def _primary_steps(state: StepState, records: list[StepIn]) -> list[StepIn]:
    """The followed rank's new records, last record of a step winning, in step order."""
    if not records:
        return []
    lowest = min(r.rank for r in records)
    if state.rank is None or lowest < state.rank:
        if state.rank is not None:  # a lower rank appeared: follow it from here
            state.follow_rank(lowest)
        state.rank = lowest
    rank = state.rank
    last = state.last_step
    latest = {r.step: r for r in records if r.rank == rank and (last is None or r.step > last)}
    return [latest[s] for s in sorted(latest)]


def _evaluate_steps(
    tracker: Tracker,
    state: StepState,
    records: list[StepIn],
    settings: dict[str, RuleSettings],
    samples: LayerSamples | None = None,
    guard: RuleGuard | None = None,
    early: precursors.PrecursorState | None = None,
) -> Judged:
    """Run the scalar rules over the batch's steps, step by step (`_StepWalk`); before each
    step, the layer `samples` of earlier steps are judged. Steps whose gradients had Inf/NaN
    (skipped, or a non-finite loss) go to `samples.bad_steps` for the underflow rules.
    Returns activation_norm_spike's judgements (`Judged`)."""
    steps = _primary_steps(state, records)
    walk = _StepWalk(tracker, state, settings, guard or RuleGuard(tracker.run.id), steps,
                     samples=samples, early=early)  # fmt: skip
    for i, record in enumerate(steps):
        walk.step(i, record)
    walk.learn()
    return walk.judged


S = TypeVar("S", bound=RuleSettings)


def _rule(settings: dict[str, RuleSettings], name: str, kind: type[S]) -> S:
    rule = settings[name]
    assert isinstance(rule, kind)
    return rule


class _StepWalk:
    """One batch's walk of the scalar rules over the followed rank's new steps. The batch's
    series and their rolling baselines are computed for the whole batch first (vectorised:
    each step's baseline is of the values before it, so a cut between batches never changes
    one); then `step`, phase by phase: the layer samples before the step, the state moved
    to it, each rule family's judgement; and `learn`, the baselines' rings after the batch."""

    def __init__(
        self,
        tracker: Tracker,
        state: StepState,
        settings: dict[str, RuleSettings],
        guard: RuleGuard,
        steps: list[StepIn],
        *,
        samples: LayerSamples | None,
        early: precursors.PrecursorState | None,
    ) -> None:
        self.tracker, self.d, self.settings, self.guard = tracker, state, settings, guard
        self.samples, self.early = samples, early
        self.judged: Judged = []
        self.collapse = _rule(settings, "loss_scale_collapse", LossScaleCollapse)
        self.skip_rate = _rule(settings, "skip_rate", SkipRate)
        self.spike = _rule(settings, "activation_norm_spike", ActivationNormSpike)
        self.stall = _rule(settings, "scale_floor_stall", ScaleFloorStall)
        self.nan_loss = _rule(settings, "nan_loss", NanLoss)
        self.loss_rule = _rule(settings, "loss_spike", LossSpike)
        self.norm_rule = _rule(settings, "grad_norm_spike", GradNormSpike)
        self.burst = _rule(settings, "overflow_burst", OverflowBurst)
        self.fell = _rule(settings, "loss_collapse", LossCollapse)
        self.width = spikes.window_width(settings)
        self._series(steps)

    def _series(self, steps: list[StepIn]) -> None:
        """What each rule learns from each step, and each step's baseline before it."""
        spike, recent = self.spike, self.d.recent
        self.acts = [act_value(record, spike) for record in steps] if spike.enabled else []
        self.act_baselines = rolling_baselines(self.d.act, self.acts, spike.baseline_steps,
                                               spike.min_baseline_steps)  # fmt: skip
        self.losses = [decode_float(r.loss) if r.loss is not None else None for r in steps]
        self.learns_losses = self.loss_rule.enabled or self.fell.enabled  # (the same medians)
        self.learns_norms = self.norm_rule.enabled or self.fell.enabled
        self.learned_losses: list[float | None] = []
        self.learned_norms: list[float | None] = []
        self.loss_baselines: list[Baseline | None] = []
        self.norm_baselines: list[Baseline | None] = []
        if self.learns_losses:
            self.learned_losses = [spikes.learned(loss, r.skipped)
                                   for loss, r in zip(self.losses, steps)]  # fmt: skip
            self.loss_baselines = spikes.baselines(recent.losses, self.learned_losses,
                                                   self.loss_rule)  # fmt: skip
        if self.learns_norms:
            self.learned_norms = [spikes.learned(finite(r.grad_norm), r.skipped) for r in steps]
            self.norm_baselines = spikes.baselines(recent.grad_norms, self.learned_norms,
                                                   self.norm_rule)  # fmt: skip

    def step(self, i: int, record: StepIn) -> None:
        """Judge the batch's `i`th step."""
        s, d = record.step, self.d
        if self.samples is not None and self.samples.due(s):
            self.guard("layer rules", s, self.samples.judge_until, s)
        scale = finite(record.loss_scale)
        loss = self.losses[i]
        nan = loss is not None and not math.isfinite(loss)
        self._move_state(s, scale, record.skipped, record.skipped or nan)
        self._scale_rules(s, scale, record.skipped)
        self._spike_rules(i, s)
        if self.nan_loss.enabled and loss is not None:
            self._judge_nan_loss(s, loss, nan)
        if self.spike.enabled and (act := self.acts[i]) is not None:
            judgement = self.guard("activation_norm_spike", s, activation_spike, self.tracker,
                                   d, s, act, self.act_baselines[i], self.spike)  # fmt: skip
            if judgement is not None:
                self.judged.append((record.rank, s, *judgement))
        if self.early is not None:
            self.guard("precursors", s, precursors.judge_step, self.tracker, self.early, record,
                       calibrating=d.calibrating, settings=self.settings)  # fmt: skip
        d.last_step = s

    def _move_state(self, s: int, scale: float | None, skipped: bool, bad: bool) -> None:
        """Move the step state to step `s`, before any rule judges it; `bad`: its gradients
        had Inf/NaN."""
        d = self.d
        if bad:
            if self.samples is not None:
                self.samples.bad_steps.append(s)
            d.last_skip = s
        if d.first_step is None:
            d.first_step = s
        d.recent.observe(s, scale, skipped, width=self.width)
        if d.calibrating:
            d.calibrate(s, scale, skipped, self.collapse)
        if scale is not None:
            d.observe_scale(s, scale, fall_window=self.spike.scale_fall_window,
                            change_window=self.collapse.window_steps)  # fmt: skip
            track_low_scale(d, d.recent, s, scale, skipped, self.collapse)
        d.observe_skip(s, skipped)

    def _scale_rules(self, s: int, scale: float | None, skipped: bool) -> None:
        """The loss-scale rules; skip_rate and overflow_burst only after calibration."""
        d, guard, tracker = self.d, self.guard, self.tracker
        guard("scale_floor_stall", s, scale_floor_stall, tracker, d, s, scale, skipped, self.stall)
        if self.collapse.enabled:
            guard("loss_scale_collapse", s, loss_scale_collapse, tracker, d, s, scale,
                  self.collapse)  # fmt: skip
        if d.calibrating:
            return
        if self.skip_rate.enabled:
            guard("skip_rate", s, judge_skip_rate, tracker, d, s, skipped, self.skip_rate)
        if self.burst.enabled:
            guard("overflow_burst", s, spikes.overflow_burst, tracker, d.recent, s, scale,
                  self.burst)  # fmt: skip

    def _spike_rules(self, i: int, s: int) -> None:
        """loss_spike, grad_norm_spike (judged after calibration, learned throughout) and
        loss_collapse, against the same rolling medians."""
        d, guard, tracker, recent = self.d, self.guard, self.tracker, self.d.recent
        if self.loss_rule.enabled and (value := self.learned_losses[i]) is not None:
            if not d.calibrating:
                guard("loss_spike", s, spikes.judge, tracker, "loss_spike", "loss", s, value,
                      self.loss_baselines[i], self.loss_rule,
                      onset=spikes.covered_from(recent.loss_step, s))  # fmt: skip
            recent.loss_step = s
        if self.norm_rule.enabled and (norm := self.learned_norms[i]) is not None:
            if not d.calibrating:
                guard("grad_norm_spike", s, spikes.judge, tracker, "grad_norm_spike",
                      "global grad norm", s, norm, self.norm_baselines[i],
                      self.norm_rule)  # fmt: skip
            recent.norm_step = s
        if self.fell.enabled:
            guard("loss_collapse", s, collapse_rule.judge, tracker, d.collapse, s,
                  self.learned_losses[i], self.loss_baselines[i], self.learned_norms[i],
                  self.norm_baselines[i], self.fell)  # fmt: skip

    def _judge_nan_loss(self, s: int, loss: float, nan: bool) -> None:
        d = self.d
        if nan:
            d.nan_since = d.nan_since if d.nan_since is not None else s
            self.tracker.holds("nan_loss", s, nan_detail(s, loss, d.nan_since),
                               onset=d.nan_since)  # fmt: skip
        else:
            d.nan_since = None
            self.tracker.clear("nan_loss", s)

    def learn(self) -> None:
        """The batch's values join the rings the next batch's baselines start from."""
        d, recent = self.d, self.d.recent
        if self.spike.enabled:
            d.act = remember(d.act, self.acts, self.spike.baseline_steps)
        if self.learns_losses:
            recent.losses = remember(recent.losses, self.learned_losses,
                                     self.loss_rule.baseline_samples)  # fmt: skip
        if self.learns_norms:
            recent.grad_norms = remember(recent.grad_norms, self.learned_norms,
                                         self.norm_rule.baseline_samples)  # fmt: skip
