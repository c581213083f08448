"""The resume plan: the restart advisor's answer turned into what a relaunch script applies.

`ampwatch.server.advisor` picks the checkpoint and the steps of data to skip; here they
become a plan (`GET /api/v1/runs/{id}/resume-plan`, `ampwatch resume-plan RUN --json`):

- the checkpoint (path, step) and the advisor's reasons it is healthy;
- the data to skip: the advisor's step range and, when the run reported its data position
  (`handle.data_position(batch, epoch=...)`, sent as sparse `data_position` events: one
  each time the position stops following its stride), the batches those steps consumed,
  per epoch, and as the flat `skip_batches` list of Lightning Fabric's `skip_batches.json`;
- the settings to change, each with its reason: a lower lr (half the lr in effect at the
  checkpoint: OPT-175B's logbook lowered the lr on restarts after a divergence); the loss
  scaler's `init_scale` and `growth_interval` from the gradients' exponent histograms
  (`ampwatch.server.loss_scale_advice`); bf16 when FP16 ran out of range (a
  non-finite loss, a collapsed or floored scale, or gradients wider than FP16's range).

`watch(resume_from=plan)` continues the run under the same id from the checkpoint's step
and sends a `resumed` event; the collector then resolves the alerts that were firing (they
belong to the abandoned steps), so the resumed process's policy acts only on new ones.
"""

from __future__ import annotations

import bisect
import math

from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.server.advisor import first_non_finite_loss, restart_candidates
from ampwatch.server.firing import firing_alerts
from ampwatch.server.incident import AdvisorConfig
from ampwatch.server.loss_scale_advice import loss_scale_advice
from ampwatch.server.models import Alert, Event, Run
from ampwatch.server.schemas.advisor import DataSkip
from ampwatch.server.schemas.resume_plan import (
    BatchRange,
    PlanAdvice,
    PlanCheckpoint,
    PlanSkip,
    ResumePlan,
)
from ampwatch.server.step_models import Step

#: The flat `skip_batches` list is given up to this many batches (ranges beyond).
MAX_SKIP_BATCHES = 10_000
#: Steps of a skip range mapped to batches at most (a plan's reads stay bounded).
MAX_SKIP_STEPS = 20_000
#: Data-position events read at most (one per break of the stride: epochs, restarts).
MAX_POSITION_EVENTS = 10_000
#: The lr on restart, as a share of the lr in effect at the checkpoint.
LR_FACTOR = 0.5
#: Rules that mean FP16 ran out of range: bf16 has FP32's exponent range.
OUT_OF_RANGE_RULES = frozenset({"loss_scale_collapse", "scale_floor_stall", "nan_loss"})

Position = tuple[int, int, int | None]  # (epoch, first batch, batches per step or None)


def resume_plan(
    session: Session, run_id: int, *, config: AdvisorConfig, margin_steps: int | None = None
) -> ResumePlan:
    """The plan for run `run_id` (which exists): checkpoint, data to skip, advice."""
    run = session.get(Run, run_id)
    assert run is not None
    advised = restart_candidates(session, run_id, config=config, margin_steps=margin_steps)
    checkpoint = None
    if advised.recommended is not None:
        chosen = next(c for c in advised.candidates if c.verdict == "recommended")
        checkpoint = PlanCheckpoint(
            step=chosen.step, path=chosen.path, time=chosen.time, reasons=chosen.reasons,
            loss_scale=chosen.loss_scale, act_norm=chosen.act_norm,
        )  # fmt: skip
    if checkpoint is not None:
        why = f"restart from the checkpoint saved at step {checkpoint.step}"
    elif advised.candidates:
        why = "no reported checkpoint is healthy: see /restart-candidates for each one's reasons"
    else:
        why = "the run reported no checkpoint (handle.checkpoint(path) records one)"
    skip = _skip(session, run_id, advised.skip_steps) if advised.skip_steps else None
    return ResumePlan(
        run_id=run_id,
        client_run_id=run.client_run_id,
        name=run.name,
        project=run.project,
        ready=checkpoint is not None,
        why=why,
        onset_step=advised.onset_step,
        onset_rule=advised.onset_rule,
        checkpoint=checkpoint,
        skip=skip,
        advice=_advice(session, run_id, checkpoint, advised.onset_step, config.rank),
        firing_alert_ids=[a.id for a in firing_alerts(session, run_id)],
    )


def _positions(session: Session, run_id: int, until: int) -> list[tuple[int, Position]]:
    """(step, position) of the latest data-position events up to step `until`, by step;
    of two at one step the later sent wins (a resumed process's, over the abandoned one's)."""
    rows = session.execute(
        select(Event.step, Event.data)
        .where(Event.run_id == run_id, Event.kind == "data_position", Event.step <= until)
        .order_by(Event.id.desc())
        .limit(MAX_POSITION_EVENTS)
    ).all()
    latest: dict[int, Position] = {}
    for step, data in reversed(rows):  # in arrival order: a later one replaces
        epoch, batch, stride = data.get("epoch"), data.get("batch"), data.get("stride")
        if step is None or not isinstance(epoch, int) or not isinstance(batch, int):
            continue
        latest[step] = (epoch, batch, stride if isinstance(stride, int) else None)
    return sorted(latest.items())


def position_at(events: list[tuple[int, Position]], step: int) -> tuple[int, int, int] | None:
    """(epoch, first batch, batches) step `step` consumed: from the event at the latest step
    at or before it (`events` by step), extended along its stride; None without one (or
    with its stride unknown past it). One bisection: a plan's range may be long.

    >>> position_at([(10, (0, 40, 4))], 12)
    (0, 48, 4)
    """
    index = bisect.bisect_right(events, step, key=lambda event: event[0]) - 1
    if index < 0:
        return None
    at, (epoch, batch, stride) = events[index]
    if at == step:
        return epoch, batch, stride or 1
    if stride is None:
        return None
    return epoch, batch + stride * (step - at), stride


def _skip(session: Session, run_id: int, steps: DataSkip) -> PlanSkip:
    end = min(steps.end, steps.start + MAX_SKIP_STEPS - 1)
    events = _positions(session, run_id, end)
    ranges: list[BatchRange] = []
    missing = 0
    for step in range(steps.start, end + 1):
        at = position_at(events, step) if events else None
        if at is None:
            missing += 1
            continue
        epoch, first, count = at
        last = first + count - 1
        if ranges and ranges[-1].epoch == epoch and first <= ranges[-1].end + 1:
            ranges[-1].end = max(ranges[-1].end, last)
        else:
            ranges.append(BatchRange(epoch=epoch, start=first, end=last))
    flat = None
    total = sum(r.end - r.start + 1 for r in ranges)
    if ranges and len({r.epoch for r in ranges}) == 1 and total <= MAX_SKIP_BATCHES:
        flat = [b for r in ranges for b in range(r.start, r.end + 1)]
    reason = steps.reason
    if ranges:
        where = ", ".join(f"epoch {r.epoch} batches {r.start}-{r.end}" for r in ranges)
        reason += f"; those steps consumed {where}"
    elif steps.end >= steps.start:
        reason += "; the run reported no data position, so only the steps are known"
    return PlanSkip(
        start=steps.start, end=steps.end, reason=reason, batches=ranges, skip_batches=flat,
        steps_without_position=missing + (steps.end - end),
    )  # fmt: skip


def _advice(
    session: Session,
    run_id: int,
    checkpoint: PlanCheckpoint | None,
    onset_step: int | None,
    rank: int,
) -> list[PlanAdvice]:
    advice: list[PlanAdvice] = []
    if checkpoint is not None and checkpoint.step is not None and onset_step is not None:
        lr = session.scalar(
            select(Step.lr)
            .where(Step.run_id == run_id, Step.rank == rank, Step.step <= checkpoint.step)
            .order_by(Step.step.desc())
            .limit(1)
        )
        if lr is not None and math.isfinite(lr) and lr > 0:
            advice.append(
                PlanAdvice(
                    setting="lr",
                    value=lr * LR_FACTOR,
                    reason=f"the run diverged (onset at step {onset_step}) training at lr "
                    f"{lr:.4g} (at step {checkpoint.step}); restart at {LR_FACTOR:g}x: "
                    "OPT-175B's team lowered the lr on restarts after a divergence",
                )
            )
    scale = loss_scale_advice(session, run_id, rank=rank)
    if scale.applies and scale.init_scale is not None and scale.growth_interval is not None:
        advice.append(PlanAdvice(setting="init_scale", value=scale.init_scale, reason=scale.reason))
        advice.append(
            PlanAdvice(setting="growth_interval", value=scale.growth_interval, reason=scale.reason)
        )
    if scale.applies:
        reasons = _out_of_range(session, run_id, rank)
        if scale.init_scale is not None and scale.safe_range is None:
            reasons.append("no loss scale keeps the gradients in FP16's range")
        if reasons:
            advice.append(
                PlanAdvice(
                    setting="precision",
                    value="bf16",
                    reason="FP16 ran out of range ("
                    + "; ".join(reasons)
                    + "): bfloat16 has FP32's exponent range and needs no loss scale",
                )
            )
    return advice


def _out_of_range(session: Session, run_id: int, rank: int) -> list[str]:
    """Signs that FP16's range, not the data, failed the run."""
    reasons: list[str] = []
    bad = first_non_finite_loss(session, run_id, rank)
    if bad is not None:
        reasons.append(f"a non-finite loss at step {bad}")
    fired = session.execute(
        select(Alert.rule, Alert.fired_step)
        .where(Alert.run_id == run_id, Alert.rule.in_(OUT_OF_RANGE_RULES),
               Alert.fired_step.is_not(None))
        .order_by(Alert.fired_step)
    ).all()  # fmt: skip
    for rule in sorted({r for r, _ in fired}):
        step = min(s for r, s in fired if r == rule and s is not None)
        reasons.append(f"{rule} fired at step {step}")
    return reasons
