"""The scalar rules' state between batches: one dataclass, serialised in one place.

Stored as the JSON of the run's ``steps`` `AlertState` row, one flat object whose keys are
the field names (so a row written before a field existed still loads: missing keys take
their defaults, unknown ones are dropped). Bounded whatever the run's length: the windows
(`changes`, `skips`, `falls`, `act`, `recent`) are cut to their rules' widths as they move.

>>> state = StepState.from_json(None)
>>> state.calibrating, state.last_step
(True, None)
>>> StepState.from_json(state.to_json()) == state
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from ampwatch.server.alerts.collapse import CollapseState
from ampwatch.server.alerts.json_copy import json_copy
from ampwatch.server.alerts.rule_settings import LossScaleCollapse
from ampwatch.server.alerts.spikes import RecentState


@dataclass
class StepState:
    """What the scalar rules remember. The run-level part survives a new process; the
    process part (`reset_process`) starts again with each one (a run start or resume)."""

    # -- the run ---------------------------------------------------------------------------
    #: The rank whose step records the scalar rules follow (the lowest that sent steps).
    rank: int | None = None
    #: The lifecycle's clear-since marks and layer-alert groups (`lifecycle.Tracker`).
    clear: dict[str, int] = field(default_factory=dict)
    groups: dict[str, Any] = field(default_factory=dict)
    last_step: int | None = None
    #: The last steps' finite final-layer activation norms: the spike baseline.
    act: list[float] = field(default_factory=list)
    #: The last step with Inf/NaN gradients (skipped or a non-finite loss).
    last_skip: int | None = None
    #: The run has reported a loss scale (FP16 with a scaler).
    scale_seen: bool = False
    #: The FP8 recipe the followed rank's latest run_start declared (`fp8_risk`), if any.
    fp8_recipe: str | None = None

    # -- the process -----------------------------------------------------------------------
    #: Warm-up calibration: a cascade that starts with the process, until a run of clean
    #: steps (`rule_settings.LossScaleCollapse`).
    calibrating: bool = True
    first_step: int | None = None
    clean_run: int = 0
    process_steps: int = 0
    cascade: bool = False
    #: The loss scaler's configured floor, as this process's run_start reported it (None:
    #: not reported; the scale rules then fall back to min_scale and floor_max_scale).
    min_loss_scale: float | None = None
    #: The process's run_start said its scaler has a history (`wire.SCALER_CALIBRATED`):
    #: calibration ends at its first step.
    calibrated_at_start: bool = False
    #: The scale of the last step, and its change points within the fall window.
    scale: float | None = None
    changes: list[list[Any]] = field(default_factory=list)
    skip_run: int = 0
    skip_run_start: int | None = None
    stall_run: int = 0
    stall_start: int | None = None
    stall_scale: float | None = None
    #: Skipped steps within the skip-rate window, counted from this step.
    skips: list[int] = field(default_factory=list)
    counted_from: int | None = None
    below_since: int | None = None
    #: The first step of the current stretch below `scale.near_floor` (a reported floor).
    near_floor_since: int | None = None
    below_falling: bool = False
    nan_since: int | None = None
    last_fall: int | None = None
    last_spike: int | None = None
    last_spike_value: float | None = None
    #: (step, octaves) of the scale's falls within the activation rule's window.
    falls: list[list[Any]] = field(default_factory=list)
    #: The longest run of skips of the current collapse incident, and where it began.
    incident_skips: int = 0
    incident_skips_from: int | None = None
    recent: RecentState = field(default_factory=RecentState)
    #: loss_collapse's state (`collapse.CollapseState`).
    collapse: CollapseState = field(default_factory=CollapseState)
    #: The process trains FP16 without a loss scaler (the agent's finding): its FP16
    #: underflow forecast (at S = 1) is its own risk.
    fp16_without_scaler: bool = False

    @staticmethod
    def reported_floor(data: dict[str, Any] | None) -> float | None:
        """`min_loss_scale` of a stored state, without loading the rest (a reader of that
        one value: the charts' rule lines, on every step-series read)."""
        floor = (data or {}).get("min_loss_scale")
        return float(floor) if isinstance(floor, (int, float)) else None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> StepState:
        data = json_copy(data) if data else {}
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names and k not in _NESTED}
        state = cls(**values)
        state.recent = RecentState.from_json(data.get("recent"))
        state.collapse = CollapseState.from_json(data.get("collapse"))
        return state

    def to_json(self) -> dict[str, Any]:
        return json_copy(self)  # type: ignore[no-any-return]

    def reset_process(self) -> None:
        """A new training process (run start or resume): calibration starts again."""
        fresh = StepState()
        for f in fields(self):
            if f.name not in _RUN_FIELDS:
                setattr(self, f.name, getattr(fresh, f.name))

    def calibrate(
        self, s: int, scale: float | None, skipped: bool, rule: LossScaleCollapse
    ) -> None:
        """Warm-up calibration at step `s`: a cascade that starts with the process (one of
        its first calibration_start_steps skipped), until a run of clean steps (or a cap).
        A process whose first steps are clean has a calibrated (restored) scaler. Its end
        starts the skip count and the fall test afresh."""
        assert self.first_step is not None  # set at the process's first step
        self.clean_run = 0 if skipped else self.clean_run + 1
        self.process_steps = self.process_steps + 1
        self.cascade = self.cascade or skipped
        if (self.calibrated_at_start
                or self.clean_run >= rule.calibration_clean_steps
                or s - self.first_step >= rule.calibration_max_steps
                or (not self.cascade
                    and self.process_steps >= rule.calibration_start_steps)):  # fmt: skip
            self.calibrating = False
            self.counted_from = s
            self.changes = [[s, scale]] if scale is not None else []
            self.skips = []
            self.last_fall = None

    def observe_scale(self, s: int, scale: float, *, fall_window: int, change_window: int) -> None:
        """Move the loss scale to step `s`: its falls within `fall_window` steps (the
        activation rule's), its change points within `change_window` (the collapse rule's
        fall test; the first one: the scale in effect at the window's start)."""
        self.scale_seen = True
        previous = self.scale
        if previous is not None and scale < previous:
            self.last_fall = s
            # Differences of logs: a quotient of two doubles can overflow to Inf.
            octaves = math.log2(previous) - math.log2(scale) if scale > 0 else 128.0
            self.falls.append([s, octaves])
        falls = self.falls
        while falls and falls[0][0] < s - fall_window:
            falls.pop(0)
        if previous is None or scale != previous or not self.changes:
            self.changes.append([s, scale])
        self.scale = scale
        changes = self.changes
        cut = 0
        while cut + 1 < len(changes) and changes[cut + 1][0] <= s - change_window:
            cut += 1
        if cut:
            del changes[:cut]

    def observe_skip(self, s: int, skipped: bool) -> None:
        """The current run of skipped steps, and where it began."""
        if skipped:
            if self.skip_run == 0:
                self.skip_run_start = s
            self.skip_run += 1
        else:
            self.skip_run = 0

    def follow_rank(self, rank: int) -> None:
        """Follow another rank's steps from here: its own sequence, its own process."""
        self.last_step, self.act, self.last_skip = None, [], None
        self.reset_process()
        self.rank = rank


#: Fields that are states of their own, serialised by their own class.
_NESTED = frozenset({"recent", "collapse"})
_RUN_FIELDS = frozenset({"rank", "clear", "groups", "last_step", "act", "last_skip", "scale_seen",
                         "fp8_recipe"})  # fmt: skip
