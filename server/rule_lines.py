"""The lines a run's rules judge it by, for the charts: `activation_norm_spike`'s settings
and the field it judges, `loss_scale_collapse`'s min_scale, the scaler floor the run
reported and the headroom line above it.

Resolved exactly as the engine resolves them (`alerts.config.settings_of_run`: run >
project > alerts file > default) and read from the engine's own state (the floor of the
followed process's run_start), with the engine's own functions (`judged_fields`,
`near_floor`): a chart line and the rule cannot drift apart. Served with every step
series (`GET /runs/{id}/steps`): two small queries besides the series' own (the
overrides, the state row), well inside the series' 50 ms bar.

>>> rule_lines(session, run_id, series).loss_scale.min_scale  # doctest: +SKIP
1.0
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server.alerts.activation import judged_fields
from ampwatch.server.alerts.config import settings_of_run
from ampwatch.server.alerts.evaluate import STEPS_KEY
from ampwatch.server.alerts.rule_settings import ActivationNormSpike, LossScaleCollapse
from ampwatch.server.alerts.scale import near_floor
from ampwatch.server.alerts.state import StepState
from ampwatch.server.models import AlertState
from ampwatch.server.schemas.runs import ActivationRuleLine, RuleLines, ScaleRuleLines, StepSeries


def rule_lines(session: Session, run_id: int, series: StepSeries) -> RuleLines:
    """Run `run_id`'s rule lines; the judged field is the first of `judged_fields` that
    `series` holds a value of."""
    settings = settings_of_run(session, run_id) or {}  # {}: the run was just deleted
    spike = settings.get("activation_norm_spike") or ActivationNormSpike()
    collapse = settings.get("loss_scale_collapse") or LossScaleCollapse()
    assert isinstance(spike, ActivationNormSpike)
    assert isinstance(collapse, LossScaleCollapse)
    held = (n for n in judged_fields(spike) if getattr(series, n).count(None) < len(series.step))
    state = StepState(min_loss_scale=StepState.reported_floor(session.scalar(
        select(AlertState.data).where(AlertState.run_id == run_id, AlertState.key == STEPS_KEY)
    )))  # fmt: skip
    return RuleLines(
        activation=ActivationRuleLine(
            enabled=spike.enabled,
            field=next(held, None),
            min_ratio=spike.min_ratio,
            z_threshold=spike.z_threshold,
            baseline_steps=spike.baseline_steps,
            min_baseline_steps=spike.min_baseline_steps,
        ),
        loss_scale=ScaleRuleLines(
            min_scale=collapse.min_scale,
            scaler_floor=state.min_loss_scale,
            floor_headroom_octaves=collapse.floor_headroom_octaves,
            floor_headroom_scale=near_floor(state, collapse),
        ),
    )
