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
against the recipe the run_start declares). This module walks a
batch's steps in order and calls them. A new scalar rule: a settings class in `rules.py`,
a function in its family's module called from `_evaluate_steps`, a README row.

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

from ampwatch.agent.wire import SCALER_CALIBRATED, decode_float
from ampwatch.server.alerts import collapse as collapse_rule
from ampwatch.server.alerts import precursors, rules, spikes
from ampwatch.server.alerts.activation import act_value, activation_spike
from ampwatch.server.alerts.config import run_settings
from ampwatch.server.alerts.fp8 import RULE as FP8_RULE
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
    reported_floor,
    scale_floor_stall,
    track_low_scale,
)
from ampwatch.server.alerts.scale import skip_rate as judge_skip_rate
from ampwatch.server.alerts.state import StepState
from ampwatch.server.baselines import remember, rolling_baselines
from ampwatch.server.fp8_readiness import recipe_of
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
    restarted = _apply_events(tracker, steps_state, batch, settings)
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
    guard("precursor leads", None, precursors.stamp_leads, session, run.id, early)
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


# -- scalar rules -------------------------------------------------------------------------


def _apply_events(
    tracker: Tracker, state: StepState, batch: BatchIn, settings: dict[str, RuleSettings]
) -> int | None:
    """Findings raise their rules; a `run_start` of the followed rank (a new process: the
    run started or resumed, maybe from an earlier checkpoint) restarts calibration and the
    step sequence and resolves the old process's findings; a `resumed` one (`watch(resume_from=
    plan)`) resolves every open alert. Returns that rank, if any."""
    restarted = None
    for event in batch.events:
        step = event.step if event.step is not None else (state.last_step or 0)
        if event.kind == "run_start":
            rank = event.data.get("rank", 0)
            rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else 0
            if state.rank is not None and rank != state.rank:
                continue  # another rank's process: the followed one still runs
            state.reset_process()
            state.min_loss_scale = reported_floor(event.data)
            state.calibrated_at_start = event.data.get(SCALER_CALIBRATED) is True
            state.last_step = None
            restarted = rank
            for rule in rules.FINDING_RULES.values():  # a new process reports its own findings
                tracker.resolve(rule, step)
            recipe = recipe_of(event.data)
            if recipe != state.fp8_recipe:  # judged against another recipe, or none, now
                state.fp8_recipe = recipe
                for layer in tracker.open_layers(FP8_RULE):
                    tracker.resolve(FP8_RULE, step, layer=layer)
        elif event.kind == "finding":
            code = str(event.data.get("code"))
            if code == "fp16_params_without_scaler":
                state.fp16_without_scaler = True
            finding_rule = rules.FINDING_RULES.get(code)
            if finding_rule is None or not settings[finding_rule].enabled:
                continue  # bf16_in_use, fp8_in_use: facts, shown as events
            message = str(event.data.get("message") or finding_rule)

            def detail(message: str = message, data: dict[str, Any] = event.data,
                       step: int = step) -> tuple[str, dict[str, Any]]:  # fmt: skip
                return f"{message} (reported at step {step})", {"finding": data, "step": step}

            tracker.holds(finding_rule, step, detail)
        elif event.kind == "resumed":  # from a resume plan: the abandoned steps' alerts end
            for rule, layer in list(tracker.open):
                tracker.resolve(rule, step, layer=layer)
    return restarted


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
    """Run the scalar rules over the batch's steps, step by step; before each step, the
    layer `samples` of earlier steps are judged. Steps whose gradients had Inf/NaN
    (skipped, or a non-finite loss) go to `samples.bad_steps` for the underflow rules.
    Returns activation_norm_spike's judgements (`Judged`)."""
    collapse: LossScaleCollapse = settings["loss_scale_collapse"]  # type: ignore[assignment]
    skip_rate: SkipRate = settings["skip_rate"]  # type: ignore[assignment]
    spike: ActivationNormSpike = settings["activation_norm_spike"]  # type: ignore[assignment]
    stall: ScaleFloorStall = settings["scale_floor_stall"]  # type: ignore[assignment]
    nan_loss: NanLoss = settings["nan_loss"]  # type: ignore[assignment]
    loss_rule: LossSpike = settings["loss_spike"]  # type: ignore[assignment]
    norm_rule: GradNormSpike = settings["grad_norm_spike"]  # type: ignore[assignment]
    burst: OverflowBurst = settings["overflow_burst"]  # type: ignore[assignment]
    fell: LossCollapse = settings["loss_collapse"]  # type: ignore[assignment]
    d = state
    recent = d.recent
    width = spikes.window_width(settings)
    steps = _primary_steps(state, records)
    values = [act_value(record, spike) for record in steps] if spike.enabled else []
    baselines = rolling_baselines(d.act, values, spike.baseline_steps, spike.min_baseline_steps)
    # What the spike rules learn from each step, and each step's baseline before it.
    losses = [decode_float(record.loss) if record.loss is not None else None for record in steps]
    learned_losses, learned_norms, loss_baselines, norm_baselines = [], [], [], []
    if loss_rule.enabled or fell.enabled:  # loss_collapse judges against the same medians
        learned_losses = [spikes.learned(loss, r.skipped) for loss, r in zip(losses, steps)]
        loss_baselines = spikes.baselines(recent.losses, learned_losses, loss_rule)
    if norm_rule.enabled or fell.enabled:
        learned_norms = [spikes.learned(finite(r.grad_norm), r.skipped) for r in steps]
        norm_baselines = spikes.baselines(recent.grad_norms, learned_norms, norm_rule)
    judged: Judged = []
    guard = guard or RuleGuard(tracker.run.id)
    for i, record in enumerate(steps):
        s = record.step
        if samples is not None:
            guard("layer rules", s, samples.judge_until, s)
        scale = finite(record.loss_scale)
        loss = losses[i]
        skipped = record.skipped
        nan = loss is not None and not math.isfinite(loss)
        if skipped or nan:
            if samples is not None:
                samples.bad_steps.append(s)
            d.last_skip = s
        if d.first_step is None:
            d.first_step = s

        recent.observe(s, scale, skipped, width=width)
        # Warm-up calibration: a cascade that starts with the process (one of its first
        # calibration_start_steps skipped), until a run of clean steps (or a cap). A
        # process whose first steps are clean has a calibrated (restored) scaler.
        if d.calibrating:
            d.clean_run = 0 if skipped else d.clean_run + 1
            d.process_steps = d.process_steps + 1
            d.cascade = d.cascade or skipped
            if (d.calibrated_at_start
                    or d.clean_run >= collapse.calibration_clean_steps
                    or s - d.first_step >= collapse.calibration_max_steps
                    or (not d.cascade
                        and d.process_steps >= collapse.calibration_start_steps)):  # fmt: skip
                d.calibrating = False
                d.counted_from = s
                d.changes = [[s, scale]] if scale is not None else []
                d.skips = []
                d.last_fall = None

        # The loss scale's change points within the fall window (the first one: the
        # scale in effect at the window's start).
        if scale is not None:
            d.scale_seen = True
            previous = d.scale
            if previous is not None and scale < previous:
                d.last_fall = s
                # Differences of logs: a quotient of two doubles can overflow to Inf.
                octaves = math.log2(previous) - math.log2(scale) if scale > 0 else 128.0
                d.falls.append([s, octaves])
            falls = d.falls
            while falls and falls[0][0] < s - spike.scale_fall_window:
                falls.pop(0)
            if previous is None or scale != previous or not d.changes:
                d.changes.append([s, scale])
            d.scale = scale
            changes = d.changes
            cut = 0
            while cut + 1 < len(changes) and changes[cut + 1][0] <= s - collapse.window_steps:
                cut += 1
            if cut:
                del changes[:cut]
            track_low_scale(d, recent, s, scale, skipped, collapse)
        if skipped:
            if d.skip_run == 0:
                d.skip_run_start = s
            d.skip_run += 1
        else:
            d.skip_run = 0

        guard("scale_floor_stall", s, scale_floor_stall, tracker, d, s, scale, skipped, stall)
        if collapse.enabled:
            guard("loss_scale_collapse", s, loss_scale_collapse, tracker, d, s, scale, collapse)
        if skip_rate.enabled and not d.calibrating:
            guard("skip_rate", s, judge_skip_rate, tracker, d, s, skipped, skip_rate)
        if burst.enabled and not d.calibrating:
            guard("overflow_burst", s, spikes.overflow_burst, tracker, recent, s, scale, burst)
        if loss_rule.enabled and (value := learned_losses[i]) is not None:
            if not d.calibrating:
                guard("loss_spike", s, spikes.judge, tracker, "loss_spike", "loss", s, value,
                      loss_baselines[i], loss_rule,
                      onset=spikes.covered_from(recent.loss_step, s))  # fmt: skip
            recent.loss_step = s
        if norm_rule.enabled and (norm := learned_norms[i]) is not None:
            if not d.calibrating:
                guard("grad_norm_spike", s, spikes.judge, tracker, "grad_norm_spike",
                      "global grad norm", s, norm, norm_baselines[i], norm_rule)  # fmt: skip
            recent.norm_step = s
        if fell.enabled:
            guard("loss_collapse", s, collapse_rule.judge, tracker, d.collapse, s,
                  learned_losses[i], loss_baselines[i], learned_norms[i], norm_baselines[i],
                  fell)  # fmt: skip
        if nan_loss.enabled and loss is not None:
            if nan:
                d.nan_since = d.nan_since if d.nan_since is not None else s
                tracker.holds("nan_loss", s, nan_detail(s, loss, d.nan_since),
                              onset=d.nan_since)  # fmt: skip
            else:
                d.nan_since = None
                tracker.clear("nan_loss", s)
        if spike.enabled and (act := values[i]) is not None:
            judgement = guard("activation_norm_spike", s, activation_spike, tracker, d, s, act,
                              baselines[i], spike)  # fmt: skip
            if judgement is not None:
                judged.append((record.rank, s, *judgement))
        if early is not None:
            guard("precursors", s, precursors.judge_step, tracker, early, record,
                  calibrating=d.calibrating, settings=settings)  # fmt: skip
        d.last_step = s

    if spike.enabled:
        d.act = remember(d.act, values, spike.baseline_steps)
    if loss_rule.enabled or fell.enabled:
        recent.losses = remember(recent.losses, learned_losses, loss_rule.baseline_samples)
    if norm_rule.enabled or fell.enabled:
        recent.grad_norms = remember(recent.grad_norms, learned_norms, norm_rule.baseline_samples)
    return judged
