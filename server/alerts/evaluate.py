"""Incremental evaluation of a run's alert rules, one ingested batch at a time.

`evaluate_batch` runs inside the ingest transaction, after the batch is stored and with the
run row locked (which serialises the collector's workers on the run). It reads the run's
`alert_state` rows, open alerts and threshold overrides (three queries), evaluates the
batch's own records against that state, and writes the state back: the cost of a batch
depends on the batch and the run's layer count, never on how long the run is.

State (JSON, one row per key):
- ``steps``: scalar rules, which follow one rank (the lowest rank that sent steps: the
  agent sends step scalars from rank 0, and all ranks share one scaler's decisions): the
  last step seen, warm-up calibration, the loss scale's change points within the fall
  window, the current run of skipped steps and of floor-stalled steps, skipped steps within
  the skip-rate window, a ring of recent final-layer activation norms, and the lifecycle's
  clear-since marks.
- ``layers``: per-layer rules, as compact arrays aligned with ``names``: the rank whose
  samples a layer follows (the first to report it: under data parallelism every rank sees
  the same reduced gradients; under pipeline parallelism each layer has one owner), the
  last sampled step, and the zero-fraction baseline (EWMA mean and mean absolute deviation).

Records at or before the state's last step (a retried or late batch) are ignored by the
rolling state, so they can never corrupt a window or a baseline; they are still stored.
"""

from __future__ import annotations

import bisect
import logging
import math
from datetime import datetime
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import decode_float
from ampwatch.server.alerts import rules, spikes
from ampwatch.server.alerts.config import run_settings
from ampwatch.server.alerts.lifecycle import Tracker
from ampwatch.server.alerts.state import StepState
from ampwatch.server.models import AlertState, Run
from ampwatch.server.schemas import BatchIn, LayerStatsIn, StepIn

logger = logging.getLogger(__name__)

STEPS_KEY = "steps"
LAYERS_KEY = "layers"


def evaluate_batch(session: Session, run: Run, batch: BatchIn, *, now: datetime) -> None:
    """Evaluate every rule of `run` on `batch` (already stored) and move its alerts.

    Call inside the ingest transaction, with the run locked; the caller commits. Runs in a
    SAVEPOINT: should evaluation ever fail, it is logged and undone, and the batch is still
    stored -- a bug here must never make an agent retry (and then drop) its data.

    >>> evaluate_batch(session, run, batch, now=utcnow())  # doctest: +SKIP
    """
    try:
        with session.begin_nested():
            _evaluate(session, run, batch, now)
    except Exception:
        logger.exception("alert evaluation of run %s failed; its batch is stored", run.id)


def _evaluate(session: Session, run: Run, batch: BatchIn, now: datetime) -> None:
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
    restarted = _apply_events(tracker, steps_state, batch, settings)
    layers_state = None
    if batch.layer_stats or (restarted is not None and LAYERS_KEY in rows):
        layers_state = _LayerState(rows[LAYERS_KEY].data if LAYERS_KEY in rows else None)
        if restarted is not None:  # its samples start again from the resumed step
            layers_state.last[layers_state.owner == restarted] = -1
    # One pass in step order: a layer sample is judged after the step records up to its
    # step and before later ones, so every rule sees the state as of its own step and the
    # alerts do not depend on how the agent cut its batches.
    samples = _LayerSamples(tracker, steps_state, layers_state, batch.layer_stats, settings)
    _evaluate_steps(tracker, steps_state, batch.steps, settings, samples)
    samples.judge_until(None)
    tracker.finish(steps_state.last_step)

    _save(session, rows, run.id, STEPS_KEY, steps_state.to_json(), now)
    if layers_state is not None:
        _save(session, rows, run.id, LAYERS_KEY, layers_state.data, now)


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


def _finite(value: Any) -> float | None:
    number = decode_float(value) if value is not None else None
    return number if number is not None and math.isfinite(number) else None


def _fmt(value: float | None) -> str:
    if value is None:
        return "none"
    return f"{value:g}"


def _octaves(ratio: float) -> str:
    """'2^-17' for a power of two, else '2^-16.6'."""
    if ratio <= 0:
        return "0"
    exponent = math.log2(ratio)
    return f"2^{exponent:.0f}" if abs(exponent - round(exponent)) < 1e-9 else f"2^{exponent:.1f}"


# -- scalar rules -------------------------------------------------------------------------


def _apply_events(
    tracker: Tracker, state: StepState, batch: BatchIn, settings: dict[str, rules.RuleSettings]
) -> int | None:
    """Findings raise their rules; a `run_start` of the followed rank (a new process: the
    run started or resumed, maybe from an earlier checkpoint) restarts calibration and the
    step sequence and resolves the old process's findings. Returns that rank, if any."""
    restarted = None
    for event in batch.events:
        step = event.step if event.step is not None else (state.last_step or 0)
        if event.kind == "run_start":
            rank = event.data.get("rank", 0)
            rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else 0
            if state.rank is not None and rank != state.rank:
                continue  # another rank's process: the followed one still runs
            state.reset_process()
            state.last_step = None
            restarted = rank
            for rule in rules.FINDING_RULES.values():  # a new process reports its own findings
                tracker.resolve(rule, step)
        elif event.kind == "finding":
            rule = rules.FINDING_RULES.get(str(event.data.get("code")))
            if rule is None or not settings[rule].enabled:
                continue  # bf16_in_use, fp8_in_use: facts, shown as events
            message = str(event.data.get("message") or rule)

            def detail(message: str = message, data: dict[str, Any] = event.data,
                       step: int = step) -> tuple[str, dict[str, Any]]:  # fmt: skip
                return f"{message} (reported at step {step})", {"finding": data, "step": step}

            tracker.holds(rule, step, detail)
    return restarted


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
    settings: dict[str, rules.RuleSettings],
    samples: _LayerSamples | None = None,
) -> None:
    """Run the scalar rules over the batch's steps, step by step; before each step, the
    layer `samples` of earlier steps are judged. Steps whose gradients had Inf/NaN
    (skipped, or a non-finite loss) go to `samples.bad_steps` for the underflow rules."""
    collapse: rules.LossScaleCollapse = settings["loss_scale_collapse"]  # type: ignore[assignment]
    skip_rate: rules.SkipRate = settings["skip_rate"]  # type: ignore[assignment]
    spike: rules.ActivationNormSpike = settings["activation_norm_spike"]  # type: ignore[assignment]
    stall: rules.ScaleFloorStall = settings["scale_floor_stall"]  # type: ignore[assignment]
    nan_loss: rules.NanLoss = settings["nan_loss"]  # type: ignore[assignment]
    loss_rule: rules.LossSpike = settings["loss_spike"]  # type: ignore[assignment]
    norm_rule: rules.GradNormSpike = settings["grad_norm_spike"]  # type: ignore[assignment]
    burst: rules.OverflowBurst = settings["overflow_burst"]  # type: ignore[assignment]
    d = state
    recent = d.recent
    width = spikes.window_width(settings)
    steps = _primary_steps(state, records)
    values = [_act_value(record, spike) for record in steps] if spike.enabled else []
    baselines = _act_baselines(d.act, values, spike)
    new_act: list[float] = []
    for i, record in enumerate(steps):
        s = record.step
        if samples is not None:
            samples.judge_until(s)
        scale = _finite(record.loss_scale)
        loss = decode_float(record.loss) if record.loss is not None else None
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
            if (d.clean_run >= collapse.calibration_clean_steps
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
                octaves = math.log2(previous / scale) if scale > 0 else 128.0
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
            # Below min_scale (or skipping at it): a collapse while the scale still falls;
            # once falling, it holds until the scale is back.
            if scale > collapse.min_scale or (scale == collapse.min_scale and not skipped):
                d.below_since = None
                d.below_falling = False
            else:
                if d.below_since is None:
                    d.below_since = s
                if not d.below_falling:
                    d.below_falling = spikes.still_falling(recent, s, scale, collapse)
        if skipped:
            if d.skip_run == 0:
                d.skip_run_start = s
            d.skip_run += 1
        else:
            d.skip_run = 0

        _scale_floor_stall(tracker, d, s, scale, skipped, stall)
        if collapse.enabled:
            _loss_scale_collapse(tracker, d, s, scale, collapse)
        if skip_rate.enabled and not d.calibrating:
            _skip_rate(tracker, d, s, skipped, skip_rate)
        if burst.enabled and not d.calibrating:
            spikes.overflow_burst(tracker, recent, s, scale, burst)
        if loss_rule.enabled:
            spikes.loss_spike(tracker, recent, s, loss, not d.calibrating, loss_rule)
        if norm_rule.enabled:
            grad_norm = _finite(record.grad_norm)
            spikes.grad_norm_spike(tracker, recent, s, grad_norm, skipped,
                                   not d.calibrating, norm_rule)  # fmt: skip
        if nan_loss.enabled and loss is not None:
            if nan:
                d.nan_since = d.nan_since if d.nan_since is not None else s
                tracker.holds("nan_loss", s, _nan_detail(s, loss, d.nan_since),
                              onset=d.nan_since)  # fmt: skip
            else:
                d.nan_since = None
                tracker.clear("nan_loss", s)
        if spike.enabled:
            value = values[i]
            if value is not None:
                _activation_spike(tracker, d, s, value, baselines[i], spike)
                if math.isfinite(value):
                    new_act.append(value)
        d.last_step = s

    if new_act:
        d.act = (d.act + new_act)[-spike.baseline_steps :]


def _loss_scale_collapse(
    tracker: Tracker, d: StepState, s: int, scale: float | None, rule: rules.LossScaleCollapse
) -> None:
    parts: list[str] = []
    values: dict[str, Any] = {"step": s, "loss_scale": scale}
    onsets: list[int] = []
    if d.below_since is not None and scale is not None and d.below_falling:
        onsets.append(d.below_since)
        where = "is below" if scale < rule.min_scale else "is skipping at"
        parts.append(f"loss scale {_fmt(scale)} {where} min_scale {_fmt(rule.min_scale)} "
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
                parts.insert(0, f"loss scale fell from {_fmt(before)} to {_fmt(scale)} "
                             f"({_octaves(scale / before)}) between steps {fall_start} "
                             f"and {s}")  # fmt: skip
                values.update(
                    peak_scale=peak,
                    peak_step=peak_step,
                    fall_start_step=fall_start,
                    scale_before_fall=before,
                    fall_octaves=math.log2(peak / scale) if scale > 0 else None,
                )
        if d.skip_run >= rule.max_consecutive_skips:
            onsets.append(d.skip_run_start)
    # The longest run of skips of this incident stays in its message after it ended.
    if d.skip_run and (d.skip_run > d.incident_skips):
        d.incident_skips, d.incident_skips_from = d.skip_run, d.skip_run_start
    if not onsets:
        d.incident_skips, d.incident_skips_from = 0, None
        tracker.clear("loss_scale_collapse", s)
        return
    if d.incident_skips >= rule.max_consecutive_skips:
        run, start = d.incident_skips, d.incident_skips_from
        ongoing = " (ongoing)" if d.skip_run == run else ""
        parts.append(f"{run} consecutive skipped steps since step {start}{ongoing}")
        values.update(consecutive_skips=run, skips_since_step=start)
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


def _scale_floor_stall(
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
    floored = d.stall_run >= rule.floor_skips and d.stall_scale <= rule.floor_max_scale
    if d.stall_run >= rule.window_steps or floored:
        run, start, floor = d.stall_run, d.stall_start, d.stall_scale
        tracker.holds(
            "scale_floor_stall",
            s,
            lambda: (
                (
                    f"all {run} steps from {start} to {s} were skipped with the loss scale "
                    f"pinned at {_fmt(floor)}: training has stopped"
                ),
                {"floor_scale": floor, "skipped_steps": run, "first_step": start, "step": s},
            ),
            onset=start,
        )
    else:
        tracker.clear("scale_floor_stall", s)


def _skip_rate(
    tracker: Tracker, d: StepState, s: int, skipped: bool, rule: rules.SkipRate
) -> None:
    skips: list[int] = d.skips
    if skipped:
        skips.append(s)
    first = s - rule.window_steps + 1
    cut = bisect.bisect_left(skips, first)
    if cut:
        del skips[:cut]
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


def _nan_detail(s: int, loss: float, since: int) -> Any:
    def detail() -> tuple[str, dict[str, Any]]:
        return (
            (
                f"loss is {loss} at step {s} (non-finite since step {since}): divergence, not a "
                "gradient-only overflow"
            ),
            {"loss": str(loss), "step": s, "non_finite_since_step": since},
        )

    return detail


def _act_value(record: StepIn, rule: rules.ActivationNormSpike) -> float | None:
    other = "act_norm_max" if rule.signal == "act_norm_mean" else "act_norm_mean"
    raw = getattr(record, rule.signal)
    if raw is None:
        raw = getattr(record, other)
    return decode_float(raw) if raw is not None else None


def _act_baselines(
    ring: list[float], values: list[float | None], rule: rules.ActivationNormSpike
) -> list[tuple[float, float] | None]:
    """For each step's `values`, the (median, scaled MAD) of the finite norms of the
    `baseline_steps` steps before it (the ring, then this batch's own), or None while too
    few. Computed per step, so a batch boundary never changes a baseline; vectorised over
    the steps whose window is full (all but a run's first `baseline_steps`)."""
    if not values:
        return []
    finite = [v for v in values if v is not None and math.isfinite(v)]
    series = np.asarray(ring + finite, dtype=np.float64)
    ends = np.empty(len(values), dtype=np.intp)  # window end (exclusive) of each step
    end = len(ring)
    for i, value in enumerate(values):
        ends[i] = end
        if value is not None and math.isfinite(value):
            end += 1
    width = rule.baseline_steps
    out: list[tuple[float, float] | None] = [None] * len(values)
    full = np.flatnonzero(ends >= width)
    if full.size:
        windows = np.lib.stride_tricks.sliding_window_view(series, width)[ends[full] - width]
        medians = np.median(windows, axis=1)
        mads = 1.4826 * np.median(np.abs(windows - medians[:, None]), axis=1)
        for i, median, mad in zip(full.tolist(), medians.tolist(), mads.tolist()):
            out[i] = (median, mad)
    for i in np.flatnonzero(ends < width).tolist():
        if ends[i] >= rule.min_baseline_steps:
            window = series[: ends[i]]
            median = float(np.median(window))
            out[i] = (median, 1.4826 * float(np.median(np.abs(window - median))))
    return out


def _scale_falling(d: StepState, s: int, rule: rules.ActivationNormSpike) -> bool:
    """The loss scale fell by 2^scale_fall_octaves within the last scale_fall_window steps."""
    octaves = sum(o for step, o in d.falls if s - step <= rule.scale_fall_window)
    return bool(octaves >= rule.scale_fall_octaves)


def _activation_spike(
    tracker: Tracker,
    d: StepState,
    s: int,
    value: float,
    baseline: tuple[float, float] | None,
    rule: rules.ActivationNormSpike,
) -> None:
    falling = _scale_falling(d, s, rule)
    # The scale falls just after a spike: the same incident, now the OPT-175B signature.
    recent_spike = d.last_spike is not None and s - d.last_spike <= rule.scale_fall_window
    if (d.last_fall == s and falling and recent_spike
            and tracker.is_open("activation_norm_spike")):  # fmt: skip
        tracker.holds("activation_norm_spike", s, lambda: _escalated(d), severity="critical")
    # A non-finite norm is a NaN/Inf forward pass: nan_loss's (or the skip's) business,
    # not a spike; it neither holds nor clears this rule.
    if baseline is None or d.calibrating or not math.isfinite(value):
        return
    median, mad = baseline
    spiking = value >= rule.min_ratio * median and (
        mad == 0 or (value - median) / mad > rule.z_threshold
    )
    if not spiking:
        tracker.clear("activation_norm_spike", s)
        return
    d.last_spike = s
    d.last_spike_value = value
    z = (value - median) / mad if mad > 0 else None
    severity = "critical" if falling else "warning"
    scale, last_fall = d.scale, d.last_fall

    def detail() -> tuple[str, dict[str, Any]]:
        message = (
            f"final-layer activation norm {_fmt(value)} at step {s} is "
            f"{value / median if median > 0 else math.inf:.1f}x its rolling median "
            f"{_fmt(median)}" + (f" (robust z {z:.0f})" if z is not None else "")
        )
        if falling:
            message += (f" while the loss scale is falling (to {_fmt(scale)} at step "
                        f"{last_fall}): the OPT-175B divergence signature")  # fmt: skip
        return message, {
            "act_norm": value,
            "baseline_median": median, "baseline_mad": mad, "robust_z": z, "step": s,
            "signal": rule.signal, "loss_scale": scale, "scale_fall_step": last_fall,
        }  # fmt: skip

    tracker.holds("activation_norm_spike", s, detail, severity=severity)


def _escalated(d: StepState) -> tuple[str, dict[str, Any]]:
    value, spike, fall, scale = d.last_spike_value, d.last_spike, d.last_fall, d.scale
    return (
        (
            f"final-layer activation norm spiked to {value} at step {spike} and the loss scale "
            f"fell to {_fmt(scale)} at step {fall}: the OPT-175B divergence signature"
        ),
        {"act_norm": value, "step": spike, "loss_scale": scale, "scale_fall_step": fall},
    )


# -- per-layer rules ----------------------------------------------------------------------


class _LayerState:
    """The ``layers`` state: parallel arrays over the run's layers (see module docstring)."""

    def __init__(self, data: dict[str, Any] | None) -> None:
        data = data or {}
        self.names: list[str] = list(data.get("names", []))
        self.index = {name: i for i, name in enumerate(self.names)}
        self.owner = np.asarray(data.get("owner", []), dtype=np.int64)
        self.last = np.asarray(data.get("last", []), dtype=np.int64)
        self.base = np.asarray(data.get("base", []), dtype=np.float64)
        self.dev = np.asarray(data.get("dev", []), dtype=np.float64)
        self.n = np.asarray(data.get("n", []), dtype=np.int64)
        # Consecutive samples each layer rule's condition held on (for_samples).
        size = len(self.names)
        self.hits = np.asarray(data.get("hits", [0] * size), dtype=np.int64)
        self.risk_hits = np.asarray(data.get("risk_hits", [0] * size), dtype=np.int64)
        self._last_names: list[str] = []
        self._last_indices = np.zeros(0, np.intp)

    def indices(self, names: list[str], rank: int) -> np.ndarray:
        """Positions of `names` in the arrays, appending new layers (owned by `rank`).
        A batch's samples usually repeat one name list: it is looked up once."""
        if names == self._last_names:
            return self._last_indices
        new = [name for name in names if name not in self.index]
        if new:
            for name in new:
                self.index[name] = len(self.names)
                self.names.append(name)
            k = len(new)
            self.owner = np.concatenate([self.owner, np.full(k, rank, np.int64)])
            self.last = np.concatenate([self.last, np.full(k, -1, np.int64)])
            self.base = np.concatenate([self.base, np.zeros(k)])
            self.dev = np.concatenate([self.dev, np.zeros(k)])
            self.n = np.concatenate([self.n, np.zeros(k, np.int64)])
            self.hits = np.concatenate([self.hits, np.zeros(k, np.int64)])
            self.risk_hits = np.concatenate([self.risk_hits, np.zeros(k, np.int64)])
        self._last_names = names
        self._last_indices = np.fromiter((self.index[name] for name in names), np.intp)
        return self._last_indices

    @property
    def data(self) -> dict[str, Any]:
        return {
            "names": self.names,
            "owner": self.owner.tolist(),
            "last": self.last.tolist(),
            "base": np.round(self.base, 6).tolist(),
            "dev": np.round(self.dev, 6).tolist(),
            "n": self.n.tolist(),
            "hits": self.hits.tolist(),
            "risk_hits": self.risk_hits.tolist(),
        }


class _LayerSamples:
    """A batch's layer samples, judged in step order as `_evaluate_steps` walks its steps
    (`judge_until`), each against the step state as of its own step."""

    def __init__(
        self,
        tracker: Tracker,
        steps: StepState,
        state: _LayerState | None,
        records: list[LayerStatsIn],
        settings: dict[str, rules.RuleSettings],
    ) -> None:
        self.tracker = tracker
        self.steps = steps
        self.state = state
        self.settings = settings
        self.queue = sorted(records, key=lambda r: r.step) if state is not None else []
        self.next = 0
        last_skip = steps.last_skip
        #: Steps whose gradients had Inf/NaN, in step order: the last one of earlier
        #: batches, then this batch's as `_evaluate_steps` meets them.
        self.bad_steps: list[int] = [last_skip] if last_skip is not None else []

    def judge_until(self, step: int | None) -> None:
        """Judge the samples of steps before `step` (None: all that are left)."""
        while self.next < len(self.queue) and (step is None or self.queue[self.next].step < step):
            record = self.queue[self.next]
            self.next += 1
            assert self.state is not None
            self._judge(record, self.state)

    def _judge(self, record: LayerStatsIn, state: _LayerState) -> None:
        underflow = self.settings["silent_underflow"]
        risk = self.settings["underflow_risk"]
        assert isinstance(underflow, rules.SilentUnderflow)
        assert isinstance(risk, rules.UnderflowRisk)
        d = self.steps
        s = record.step
        idx = state.indices(record.names, record.rank)
        fresh = (state.owner[idx] == record.rank) & (state.last[idx] < s)
        if not fresh.any():
            return
        bad = self.bad_steps
        at = bisect.bisect_left(bad, s - underflow.explain_window_steps)
        explained = at < len(bad) and bad[at] <= s
        max_abs = record.stats.get("max_abs_scaled")
        if max_abs is not None:  # Inf/NaN in the layer's own gradients explains its zeros
            fresh_ok = fresh & np.isfinite(max_abs)
        else:
            fresh_ok = fresh
        calibrating = bool(d.calibrating)
        zero = record.stats.get("zero_fraction")
        if zero is not None and underflow.enabled:
            _silent_underflow(self.tracker, state, record, idx, zero, fresh_ok, explained,
                              calibrating, underflow)  # fmt: skip
        flush = record.stats.get("flush_fraction")
        judge_risk = (
            risk.enabled and not calibrating and (d.scale_seen or not risk.only_with_loss_scale)
        )
        if flush is not None and judge_risk:
            _underflow_risk(self.tracker, state, record, idx, flush, fresh_ok, risk)
        state.last[idx[fresh]] = s


def _silent_underflow(
    tracker: Tracker,
    state: _LayerState,
    record: LayerStatsIn,
    idx: np.ndarray,
    zero: np.ndarray,
    fresh: np.ndarray,
    explained: bool,
    calibrating: bool,
    rule: rules.SilentUnderflow,
) -> None:
    s = record.step
    valid = fresh & np.isfinite(zero)
    if explained or not valid.any():
        return
    base, dev, n = state.base[idx], state.dev[idx], state.n[idx]
    has_baseline = n >= rule.baseline_samples
    judged = valid & has_baseline & (not calibrating)
    excess = zero - base
    # A whole tensor at exactly zero is not learning: judged from its first sample, with
    # or without a baseline (see `SilentUnderflow.frozen_max_baseline`).
    frozen = valid & (zero >= 1.0) & (
        (rule.frozen_max_baseline >= 1.0) | (has_baseline & (base <= rule.frozen_max_baseline))
    )
    raised = (excess >= rule.min_increase) & (excess >= rule.spread_factor * dev)
    firing = (judged & raised) | frozen
    counted = judged | (valid & ~has_baseline)  # where a clear sample resets the count
    hits = np.where(firing, state.hits[idx] + 1, np.where(counted, 0, state.hits[idx]))
    state.hits[idx] = hits

    # Baselines learn from healthy samples only, so a sustained underflow never becomes
    # the layer's new normal: a running mean first, then an EWMA.
    learn = valid & ~firing
    weight = np.where(n < rule.baseline_samples, 1.0 / (n + 1), rule.baseline_alpha)
    new_base = base + weight * (zero - base)
    new_dev = dev + weight * (np.abs(zero - base) - dev)
    state.base[idx] = np.where(learn, new_base, base)
    state.dev[idx] = np.where(learn, new_dev, dev)
    state.n[idx] = np.where(learn, n + 1, n)

    for j in np.flatnonzero(firing):
        name = record.names[j]
        if tracker.still_firing("silent_underflow", name):
            continue
        value, baseline, spread = float(zero[j]), float(base[j]), float(dev[j])
        is_frozen = bool(frozen[j])

        def detail(name: str = name, value: float = value, baseline: float = baseline,
                   spread: float = spread, is_frozen: bool = is_frozen,
                   ) -> tuple[str, dict[str, Any]]:  # fmt: skip
            what = (
                "all of its gradients are exactly zero (frozen)"
                if is_frozen
                else (
                    f"{value:.1%} of its gradients are exactly zero against a baseline of "
                    f"{baseline:.1%}"
                )
            )
            return (
                (f"layer {name}: {what} at step {s}, with no skipped step or Inf/NaN to "
                "explain it: the layer has stopped learning"),
                {"zero_fraction": value, "baseline": baseline, "baseline_deviation": spread,
                 "frozen": is_frozen, "step": s},
            )  # fmt: skip

        tracker.holds("silent_underflow", s, detail, layer=name,
                      ready=bool(hits[j] >= rule.for_samples))  # fmt: skip
    # Clear where judged, and where only the frozen test applies (no baseline yet).
    clear = (judged | (valid & ~has_baseline)) & ~firing
    _clear_open(tracker, "silent_underflow", record, clear)


def _underflow_risk(
    tracker: Tracker,
    state: _LayerState,
    record: LayerStatsIn,
    idx: np.ndarray,
    flush: np.ndarray,
    fresh: np.ndarray,
    rule: rules.UnderflowRisk,
) -> None:
    s = record.step
    valid = fresh & np.isfinite(flush)
    risky = valid & (flush >= rule.max_flush_fraction)
    hits = np.where(risky, state.risk_hits[idx] + 1, np.where(valid, 0, state.risk_hits[idx]))
    state.risk_hits[idx] = hits
    for j in np.flatnonzero(risky):
        name, value = record.names[j], float(flush[j])
        if tracker.still_firing("underflow_risk", name):
            continue

        def detail(name: str = name, value: float = value) -> tuple[str, dict[str, Any]]:
            return (
                (f"layer {name}: {value:.1%} of its scaled gradients would flush to zero in "
                f"FP16 at step {s} (threshold {rule.max_flush_fraction:.0%})"),
                {"flush_fraction": value, "max_flush_fraction": rule.max_flush_fraction,
                 "step": s},
            )  # fmt: skip

        tracker.holds("underflow_risk", s, detail, layer=name,
                      ready=bool(hits[j] >= rule.for_samples))  # fmt: skip
    _clear_open(tracker, "underflow_risk", record, valid & ~risky)


def _clear_open(tracker: Tracker, rule: str, record: LayerStatsIn, clear: np.ndarray) -> None:
    """`rule` is clear at this sample for the layers in `clear`: tell the open ones (few;
    looping over every layer of a 500-layer record for nothing cost milliseconds)."""
    open_layers = tracker.open_layers(rule)
    if not open_layers:
        return
    position = {name: j for j, name in enumerate(record.names)}
    for layer in open_layers:
        j = position.get(layer)
        if j is not None and clear[j]:
            tracker.clear(rule, record.step, layer=layer)
