"""The incident the restart advisor keeps checkpoints clear of, and its thresholds.

The run's live-branch alerts as spans (`run_alerts`); the onset of its first incident that
reached critical, chained back through the precursors open when it began
(`incident_onset`); the margin a healthy checkpoint keeps before it (`margin_for`); and
the thresholds of every judgement (`AdvisorConfig`, a run's own: `run_config`). The why
of each is in `ampwatch.server.advisor`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server.alerts.config import settings_of_run
from ampwatch.server.alerts.rule_settings import LossScaleCollapse
from ampwatch.server.alerts.rules import CONFIGURATION_RULES
from ampwatch.server.baselines import HEALTHY_LOSS_SCALE
from ampwatch.server.models import Alert, Run

#: Rules whose alerts announce or make up a divergence: chained into the incident that
#: reached critical. Others (no_data, configuration findings, per-layer underflow
#: warnings that may stand for the whole run) would drag the onset back to step 0.
PRECURSOR_RULES = frozenset(
    {
        "activation_norm_spike",
        "skip_rate",
        "loss_scale_collapse",
        "scale_floor_stall",
        "nan_loss",
        "loss_spike",
        "grad_norm_spike",
        "overflow_burst",
        "loss_collapse",
    }
)
#: Never part of an incident: the agent going quiet says nothing about the weights, and a
#: configuration finding is no incident (`ampwatch.server.advisor`'s docstring, 2.).
#: (The early warnings, `alerts.precursors`, warn of an event to come: the incident's onset
#: is the event's, and their own lead is recorded on them.)
NOT_PRECURSORS = frozenset({"no_data", "update_rms_rise", "scale_decline", "flush_trend"}) | (
    CONFIGURATION_RULES
)


@dataclass(frozen=True)
class AdvisorConfig:
    """The advisor's thresholds (`ampwatch.server.advisor`'s docstring); every one can be
    overridden."""

    #: The lowest healthy loss scale (not the scaler's floor, which `watch()` and
    #: `run_start` call `min_loss_scale`).
    healthy_loss_scale: float = HEALTHY_LOSS_SCALE
    fall_window: int = 20
    baseline_buckets: int = 16
    baseline_k: float = 4.0
    #: The baseline's spread is at least this share of its median: a norm that barely
    #: moves must not reject a checkpoint for a 1% wobble.
    baseline_rel_floor: float = 0.05
    margin_fraction: float = 0.02
    margin_min_steps: int = 20
    incident_gap: int = 50
    #: Steps after the onset whose data is worth skipping on restart; None: the margin.
    skip_after_onset: int | None = None
    rank: int = 0
    precursor_rules: frozenset[str] = field(default=PRECURSOR_RULES)


@dataclass(frozen=True)
class AlertSpan:
    rule: str
    layer: str
    severity: str
    started_step: int
    fired_step: int | None
    resolved_step: int | None

    def firing_at(self, step: int) -> bool:
        return (
            self.fired_step is not None
            and self.fired_step <= step
            and (self.resolved_step is None or step < self.resolved_step)
        )


@dataclass(frozen=True)
class Onset:
    step: int
    rule: str


def incident_onset(alerts: list[AlertSpan], *, config: AdvisorConfig) -> Onset | None:
    """Where the run's first incident that reached critical began, or None if none did.

    >>> incident_onset([AlertSpan("skip_rate", "", "warning", 90, 95, None),
    ...                 AlertSpan("loss_scale_collapse", "", "critical", 110, 112, None)],
    ...                config=AdvisorConfig())
    Onset(step=90, rule='skip_rate')
    """
    criticals = [
        a
        for a in alerts
        if a.severity == "critical" and a.fired_step is not None and a.rule not in NOT_PRECURSORS
    ]
    if not criticals:
        return None
    first = min(criticals, key=lambda a: (a.fired_step, a.started_step))
    members = [
        a
        for a in alerts
        if a.rule not in NOT_PRECURSORS
        and (a.severity == "critical" or a.rule in config.precursor_rules)
    ]
    onset = Onset(first.started_step, first.rule)
    moved = True
    while moved:  # chain back: each member open (or just closed) when the next began
        moved = False
        for alert in members:
            open_then = alert.resolved_step is None or (
                alert.resolved_step >= onset.step - config.incident_gap
            )
            if alert.started_step < onset.step and open_then:
                onset = Onset(alert.started_step, alert.rule)
                moved = True
    return onset


def margin_for(last_step: int | None, *, config: AdvisorConfig) -> int:
    """Steps a healthy checkpoint must precede the onset by: a share of the run, floored."""
    return max(config.margin_min_steps, math.ceil(config.margin_fraction * (last_step or 0)))


def run_alerts(session: Session, run_id: int) -> list[AlertSpan]:
    """The alerts of the run's live branch: after a resume from a plan, only those started
    since (`Run.resumed_at`); the abandoned branch's incident is over, and chaining back
    into it would put a new incident's onset before the checkpoint the run resumed from."""
    run = session.get(Run, run_id)
    since = () if run is None or run.resumed_at is None else (Alert.started_at >= run.resumed_at,)
    rows = session.execute(
        select(
            Alert.rule,
            Alert.layer,
            Alert.severity,
            Alert.started_step,
            Alert.fired_step,
            Alert.resolved_step,
        ).where(Alert.run_id == run_id, *since)
    ).all()
    return [AlertSpan(*row) for row in rows]


def run_config(session: Session, run_id: int, **overrides: Any) -> AdvisorConfig:
    """The advisor's thresholds for run `run_id`: `healthy_loss_scale` is the run's effective
    `loss_scale_collapse.min_scale` (run > project > file > default), so the advisor and
    the collapse alert agree on what a healthy scale is; `overrides` win over both.

    >>> run_config(session, 7, healthy_loss_scale=0.5).healthy_loss_scale  # doctest: +SKIP
    0.5
    """
    settings = None if "healthy_loss_scale" in overrides else settings_of_run(session, run_id)
    if settings is not None:
        collapse = settings["loss_scale_collapse"]
        assert isinstance(collapse, LossScaleCollapse)
        overrides["healthy_loss_scale"] = collapse.min_scale
    return AdvisorConfig(**overrides)
