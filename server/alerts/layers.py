"""The per-layer rules, `silent_underflow` and `underflow_risk`, and their state: compact
arrays aligned with the run's layer names (owner rank, last sampled step, the zero-fraction
baseline as an EWMA mean and mean absolute deviation, and each rule's count of consecutive
raised samples, its `for_samples`; `fp8_risk`'s own last FP8 sample and count, its rule in
`alerts.fp8`). Samples are judged in step order as the engine walks a batch's steps
(`LayerSamples.judge_until`)."""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from ampwatch.agent.wire import LAYER_STATS
from ampwatch.server.alerts import precursors
from ampwatch.server.alerts.fp8 import FP8_RECORD_STATS, fp8_risk
from ampwatch.server.alerts.layer_settings import FlushTrend, SilentUnderflow, UnderflowRisk
from ampwatch.server.alerts.lifecycle import Tracker
from ampwatch.server.alerts.numbers import shares
from ampwatch.server.alerts.rule_settings import RuleSettings
from ampwatch.server.alerts.state import StepState
from ampwatch.server.schemas.wire import LayerStatsIn

#: The gradient statistics these rules read; a record with none of them is not a sample.
GRADIENT_STATS = frozenset(LAYER_STATS)


class LayerState:
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
        self.fp8_last = np.asarray(data.get("fp8_last", [-1] * size), dtype=np.int64)
        self.fp8_hits = np.asarray(data.get("fp8_hits", [0] * size), dtype=np.int64)
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
            self.fp8_last = np.concatenate([self.fp8_last, np.full(k, -1, np.int64)])
            self.fp8_hits = np.concatenate([self.fp8_hits, np.zeros(k, np.int64)])
        self._last_names = names
        self._last_indices = np.fromiter((self.index[name] for name in names), np.intp)
        return self._last_indices

    @property
    def data(self) -> dict[str, Any]:
        return {
            "names": self.names,
            "owner": self.owner.tolist(),
            "last": self.last.tolist(),
            "base": _rounded(self.base),
            "dev": _rounded(self.dev),
            "n": self.n.tolist(),
            "hits": self.hits.tolist(),
            "risk_hits": self.risk_hits.tolist(),
            "fp8_last": self.fp8_last.tolist(),
            "fp8_hits": self.fp8_hits.tolist(),
        }

    def restart(self, rank: int) -> None:
        """`rank` started a new process: its layers' samples start again from its step."""
        owned = self.owner == rank
        self.last[owned] = -1
        self.fp8_last[owned] = -1


def _rounded(values: np.ndarray) -> list[float]:
    """`values` to 6 decimals (a smaller state row). Beyond 1e15 a float64 has no decimals
    to drop, and rounding's x * 1e6 overflowed to inf past ~1.8e302 (a layer statistic of
    1e303 made its baseline inf, which PostgreSQL's JSON refuses: the batch's alerts were
    undone).

    >>> _rounded(np.array([0.1234567, 1e303, -1e303]))
    [0.123457, 1e+303, -1e+303]
    """
    small = np.abs(values) < 1e15
    rounded: list[float] = np.where(
        small, np.round(np.where(small, values, 0.0), 6), values
    ).tolist()
    return rounded


class LayerSamples:
    """A batch's layer samples, judged in step order as `_evaluate_steps` walks its steps
    (`judge_until`), each against the step state as of its own step."""

    def __init__(
        self,
        tracker: Tracker,
        steps: StepState,
        state: LayerState | None,
        records: list[LayerStatsIn],
        settings: dict[str, RuleSettings],
    ) -> None:
        self.tracker = tracker
        self.steps = steps
        self.state = state
        self.settings = settings
        self.queue = sorted(records, key=lambda r: r.step) if state is not None else []
        #: The early-warning rules' state (`flush_trend`), set by the engine.
        self.precursors: precursors.PrecursorState | None = None
        self.next = 0
        last_skip = steps.last_skip
        #: Steps whose gradients had Inf/NaN, in step order: the last one of earlier
        #: batches, then this batch's as `_evaluate_steps` meets them.
        self.bad_steps: list[int] = [last_skip] if last_skip is not None else []

    def due(self, step: int) -> bool:
        """A sample of a step before `step` waits to be judged (asked at every step)."""
        return self.next < len(self.queue) and self.queue[self.next].step < step

    def judge_until(self, step: int | None) -> None:
        """Judge the samples of steps before `step` (None: all that are left). An FP8
        sample's roles (one record each) are of one step, so they are judged together."""
        fp8: list[LayerStatsIn] = []
        while self.next < len(self.queue) and (step is None or self.queue[self.next].step < step):
            record = self.queue[self.next]
            self.next += 1
            assert self.state is not None
            if FP8_RECORD_STATS.intersection(record.stats):
                fp8.append(record)
            self._judge(record, self.state)
        if fp8:
            assert self.state is not None
            fp8_risk(self.tracker, self.state, fp8, self.steps.fp8_recipe, self.settings)

    def _judge(self, record: LayerStatsIn, state: LayerState) -> None:
        underflow = self.settings["silent_underflow"]
        risk = self.settings["underflow_risk"]
        assert isinstance(underflow, SilentUnderflow)
        assert isinstance(risk, UnderflowRisk)
        if not GRADIENT_STATS.intersection(record.stats):
            return  # FP8 readiness records (wire.FP8_STATS) say nothing of underflow
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
        subnormal = record.stats.get("subnormal_fraction")
        fp16 = d.scale_seen or d.fp16_without_scaler  # its FP16 forecast is its own risk
        judge_risk = risk.enabled and not calibrating and (fp16 or not risk.only_with_loss_scale)
        if flush is not None and judge_risk:
            _underflow_risk(self.tracker, state, record, idx, flush, subnormal, fresh_ok, risk)
        trend = self.settings["flush_trend"]
        assert isinstance(trend, FlushTrend)
        early = self.precursors
        if flush is not None and trend.enabled and early is not None and fp16 and not calibrating:
            precursors.judge_flush(self.tracker, early, record, flush, fresh_ok, trend)
        state.last[idx[fresh]] = s


def _silent_underflow(
    tracker: Tracker,
    state: LayerState,
    record: LayerStatsIn,
    idx: np.ndarray,
    zero: np.ndarray,
    fresh: np.ndarray,
    explained: bool,
    calibrating: bool,
    rule: SilentUnderflow,
) -> None:
    s = record.step
    valid = fresh & shares(zero)
    if explained or not valid.any():
        return
    base, dev, n = state.base[idx], state.dev[idx], state.n[idx]
    has_baseline = n >= rule.baseline_samples
    judged = valid & has_baseline & (not calibrating)
    excess = zero - base
    # A whole tensor at exactly zero is not learning: judged from its first sample, with
    # or without a baseline (see `SilentUnderflow.frozen_max_baseline`).
    frozen = (
        valid
        & (zero >= 1.0)
        & ((rule.frozen_max_baseline >= 1.0) | (has_baseline & (base <= rule.frozen_max_baseline)))
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
    tracker.clear_layers("silent_underflow", record.step, record.names, clear)


def _underflow_risk(
    tracker: Tracker,
    state: LayerState,
    record: LayerStatsIn,
    idx: np.ndarray,
    flush: np.ndarray,
    subnormal: np.ndarray | None,
    fresh: np.ndarray,
    rule: UnderflowRisk,
) -> None:
    s = record.step
    valid = fresh & shares(flush)
    if subnormal is None:
        subnormal = np.zeros_like(flush)
    near = np.nan_to_num(subnormal, nan=0.0) >= rule.max_subnormal_fraction
    risky = valid & ((flush >= rule.max_flush_fraction) | near)
    hits = np.where(risky, state.risk_hits[idx] + 1, np.where(valid, 0, state.risk_hits[idx]))
    state.risk_hits[idx] = hits
    for j in np.flatnonzero(risky):
        name, value, sub = record.names[j], float(flush[j]), float(subnormal[j])
        if tracker.still_firing("underflow_risk", name):
            continue

        def detail(name: str = name, value: float = value,
                   sub: float = sub) -> tuple[str, dict[str, Any]]:  # fmt: skip
            return (
                (f"layer {name}: {value:.1%} of its scaled gradients would flush to zero in "
                 f"FP16 and {sub:.1%} sit in FP16's subnormal range at step {s} (thresholds "
                 f"{rule.max_flush_fraction:.0%}, {rule.max_subnormal_fraction:.0%})"),
                {"flush_fraction": value, "max_flush_fraction": rule.max_flush_fraction,
                 "subnormal_fraction": sub,
                 "max_subnormal_fraction": rule.max_subnormal_fraction, "step": s},
            )  # fmt: skip

        tracker.holds("underflow_risk", s, detail, layer=name,
                      ready=bool(hits[j] >= rule.for_samples))  # fmt: skip
    tracker.clear_layers("underflow_risk", record.step, record.names, valid & ~risky)
