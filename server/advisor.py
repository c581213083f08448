"""The restart advisor: which of a run's checkpoints to restart from, and why.

A checkpoint is *healthy* when, at its step (DESIGN, "Restart advisor"):

1. the loss scale was >= `healthy_loss_scale` (the run's effective `loss_scale_collapse`
   `min_scale`, 1.0 by default: the OPT-175B team's "healthy" scalar) and
   not mid-fall: no strict fall of the scale between consecutive steps in the
   `fall_window` steps up to it, nor across its own step (a fall from step s to s+1 means
   step s itself overflowed, and the saved scaler state already holds the halving);
2. no critical alert was firing (fired_step <= step < resolved_step, or not resolved),
   configuration findings (`CONFIGURATION_RULES`: FP16 without a loss scaler, clipping
   before unscale_) excepted: they hold for the whole process, so no checkpoint of it is
   free of them and restarting from any checkpoint does not fix them. They are neither an
   incident's onset; every candidate carries a caveat instead ("fix that before
   restarting");
3. the final-layer activation norm (mean over tokens) was within the run's own robust
   baseline before it: <= median + k * 1.4826 * MAD (`ampwatch.server.baselines`) of the
   step-rollup extremes of the `baseline_buckets` rollups (64 steps each) that end before it;
4. it precedes the incident onset by at least `margin_steps`;
5. it was saved before the run's first non-finite loss, whatever the alerts say (a NaN run
   can end "succeeded" and leave a poisoned checkpoint; the first non-finite loss is found
   from the step rollups, where NaN wins the maximum, and then the one bucket's raw steps).

With the recommendation comes the data to skip on restart (`skip_steps`): from the
checkpoint's next step to the incident onset plus `skip_after_onset` steps (default: the
margin), because the batches just before and at a spike are its likeliest trigger (PaLM's
team restarted ~100 steps before a spike and skipped 200-500 batches; Lightning's
SpikeDetection writes the spike's batch and the one before it to skip_batches.json).

The incident is the first one that reached critical in the run's live branch (after a
resume from a plan, only the alerts and checkpoints since the resume count: `run_alerts`,
`run_checkpoints(live=True)`; the abandoned steps were moved aside,
`ampwatch.server.rollback`): the critical alert that fired first, plus every precursor
(`PRECURSOR_RULES`, or any critical alert) still open, or resolved less than
`incident_gap` steps, when the incident's earliest member started. Its onset is
the earliest `started_step` among them: for OPT-175B's signature that is the activation
norm spike, not the collapse of the scale that followed.

Why a margin: a rule's condition is a threshold over a baseline, so it first holds some
way into the build-up of an incident (the norm grows for a while before it is "far above"
its baseline), and a checkpoint saved during that build-up already holds weights on their
way to diverging. The default margin is 2% of the run (at least 20 steps): one checkpoint
interval of a typical long run, and a cheap insurance next to restarting into the same
divergence. Pass `margin_steps` to override it.

Reads stay cheap on long runs: per checkpoint, the ~`fall_window` raw steps up to it and
at most `baseline_buckets` rollup rows (falling back to at most 256 raw steps when too
few rollups precede an early checkpoint), plus the run's alerts.

>>> restart_candidates(session, run_id)  # doctest: +SKIP
RestartCandidates(run_id=7, onset_step=115, onset_rule='activation_norm_spike', ...)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import encode_float
from ampwatch.server.alerts.rules import CONFIGURATION_RULES
from ampwatch.server.baselines import robust_baseline
from ampwatch.server.history import run_checkpoints
from ampwatch.server.incident import (
    AdvisorConfig,
    AlertSpan,
    Onset,
    incident_onset,
    margin_for,
    run_alerts,
    run_config,
)
from ampwatch.server.rollups import ROLLUP_WIDTH
from ampwatch.server.schemas.advisor import (
    DataSkip,
    RestartCandidate,
    RestartCandidates,
    RestartCheckpoint,
)
from ampwatch.server.schemas.runs import CheckpointPublic
from ampwatch.server.step_models import Step, StepRollup

#: The caveat each configuration finding adds to every candidate.
CONFIGURATION_CAVEATS = {
    "fp16_without_scaler": "the run trains FP16 without a loss scaler: fix that before restarting",
    "clip_before_unscale": "the run clips gradients before scaler.unscale_ (the threshold "
    "is off by the loss scale): fix that before restarting",
}
#: Fewer baseline values than this: the activation norm is not judged.
MIN_BASELINE_VALUES = 8


def _fmt(value: float, digits: int = 6) -> str:
    """A value for a reason: 6 significant digits (loss scales are exact powers of two
    up to 2^19), or the wire's "NaN" / "Infinity"."""
    return f"{value:.{digits}g}" if math.isfinite(value) else str(encode_float(value))


def _fmt3(value: float) -> str:
    return _fmt(value, 3)


def first_non_finite_loss(session: Session, run_id: int, rank: int) -> int | None:
    """The run's first step whose loss was NaN or infinite, or None. One indexed read of the
    rollups (one row per 64 steps; NaN orders above every number, in SQLite as the text
    'NaN' and in PostgreSQL natively, so it passes `> 1e308` like +Inf), then the one
    bucket's raw steps, judged in Python."""
    start = session.scalar(
        select(StepRollup.bucket_start)
        .where(StepRollup.run_id == run_id, StepRollup.rank == rank,
               (StepRollup.loss_max > 1e308) | (StepRollup.loss_min < -1e308))
        .order_by(StepRollup.bucket_start)
        .limit(1)
    )  # fmt: skip
    if start is None:
        return None
    losses = session.execute(
        select(Step.step, Step.loss)
        .where(Step.run_id == run_id, Step.rank == rank,
               Step.step.between(start, start + ROLLUP_WIDTH - 1))
        .order_by(Step.step)
    ).all()  # fmt: skip
    for step, loss in losses:
        if loss is not None and not math.isfinite(loss):
            return int(step)
    return None


def _baseline(session: Session, run_id: int, step: int, config: AdvisorConfig) -> list[float]:
    """Activation norms before `step` to judge it against: the min and max of each of the
    latest rollups that end before it, or the raw steps for an early checkpoint."""
    rollups = session.execute(
        select(StepRollup.act_norm_mean_min, StepRollup.act_norm_mean_max)
        .where(
            StepRollup.run_id == run_id,
            StepRollup.rank == config.rank,
            StepRollup.bucket_start <= step - ROLLUP_WIDTH,
        )
        .order_by(StepRollup.bucket_start.desc())
        .limit(config.baseline_buckets)
    ).all()
    values = [v for row in rollups for v in row if v is not None and math.isfinite(v)]
    if len(values) >= MIN_BASELINE_VALUES:
        return values
    raw = session.scalars(
        select(Step.act_norm_mean).where(
            Step.run_id == run_id,
            Step.rank == config.rank,
            Step.step.between(max(0, step - 4 * ROLLUP_WIDTH), step - 1),
        )
    ).all()
    return [v for v in raw if v is not None and math.isfinite(v)]


@dataclass
class _Judgement:
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    loss_scale: float | None = None
    act_norm: float | None = None


def _judge(
    session: Session,
    run_id: int,
    checkpoint: CheckpointPublic,
    alerts: list[AlertSpan],
    onset: Onset | None,
    margin: int,
    config: AdvisorConfig,
    first_bad_loss: int | None = None,
) -> _Judgement:
    verdict = _Judgement()
    step = checkpoint.step
    if step is None:
        verdict.failures.append("the checkpoint event carries no step")
        return verdict
    if first_bad_loss is not None and step >= first_bad_loss:
        verdict.failures.append(
            f"saved at or after the run's first non-finite loss (step {first_bad_loss}): "
            "its weights may already hold NaN/Inf"
        )
    rows = session.execute(
        select(Step.step, Step.loss_scale, Step.act_norm_mean)
        .where(
            Step.run_id == run_id,
            Step.rank == config.rank,
            Step.step.between(max(0, step - config.fall_window), step + 1),
        )
        .order_by(Step.step)
    ).all()
    at = [row for row in rows if row.step <= step]
    if not at:
        verdict.failures.append(
            f"no step data within {config.fall_window} steps before step {step}: "
            "its health cannot be checked"
        )
    else:
        here = at[-1]
        verdict.loss_scale, verdict.act_norm = here.loss_scale, here.act_norm_mean
        _judge_scale(verdict, rows, here.loss_scale, config)
        _judge_act_norm(verdict, session, run_id, step, here.act_norm_mean, config)
    for alert in alerts:
        if alert.rule in CONFIGURATION_RULES:
            continue  # a caveat of every candidate, not a verdict on this one
        if alert.severity == "critical" and alert.firing_at(step):
            where = f" on {alert.layer}" if alert.layer else ""
            verdict.failures.append(
                f"critical alert {alert.rule}{where} firing at step {step} "
                f"(fired at step {alert.fired_step})"
            )
    if onset is not None:
        if step >= onset.step:
            verdict.failures.append(f"after incident onset at step {onset.step} ({onset.rule})")
        elif onset.step - step < margin:
            verdict.failures.append(
                f"only {onset.step - step} steps before incident onset at step {onset.step} "
                f"({onset.rule}); the margin is {margin} steps"
            )
        else:
            verdict.notes.append(
                f"{onset.step - step} steps before onset at step {onset.step} ({onset.rule})"
            )
    else:
        verdict.notes.append("no incident reached critical")
    return verdict


def _judge_scale(
    verdict: _Judgement, rows: Sequence[Any], scale: float | None, config: AdvisorConfig
) -> None:
    if scale is None:
        verdict.notes.insert(0, "no loss scale reported (no scaler)")
        return
    if not scale >= config.healthy_loss_scale:  # NaN fails too
        verdict.failures.append(f"loss scale {_fmt(scale)} < {_fmt(config.healthy_loss_scale)}")
    else:
        verdict.notes.insert(0, f"scale {_fmt(scale)}")
    falls = [
        (before, after)
        for before, after in pairwise(rows)
        if before.loss_scale is not None
        and after.loss_scale is not None
        and after.loss_scale < before.loss_scale
    ]
    if falls:
        before, after = falls[-1]
        verdict.failures.append(
            f"loss scale mid-fall: {_fmt(before.loss_scale)} -> {_fmt(after.loss_scale)} "
            f"between steps {before.step} and {after.step} (window: {config.fall_window} "
            "steps up to the checkpoint and its own step)"
        )


def _judge_act_norm(
    verdict: _Judgement,
    session: Session,
    run_id: int,
    step: int,
    norm: float | None,
    config: AdvisorConfig,
) -> None:
    if norm is None:
        verdict.notes.append("no activation norm reported")
        return
    if not math.isfinite(norm):
        verdict.failures.append(f"act norm {_fmt3(norm)} is not finite")
        return
    values = _baseline(session, run_id, step, config)
    if len(values) < MIN_BASELINE_VALUES:
        verdict.notes.append(f"act norm {_fmt3(norm)} (too little history for a baseline)")
        return
    center, sigma = robust_baseline(values)
    band = config.baseline_k * max(sigma, config.baseline_rel_floor * abs(center))
    if norm > center + band:
        verdict.failures.append(
            f"act norm {_fmt3(norm)} above baseline {_fmt3(center)}±{band:.2g} "
            f"(limit {_fmt3(center + band)})"
        )
    else:
        verdict.notes.append(f"act norm {_fmt3(norm)} within baseline {_fmt3(center)}±{band:.2g}")


def restart_candidates(
    session: Session,
    run_id: int,
    *,
    config: AdvisorConfig | None = None,
    margin_steps: int | None = None,
) -> RestartCandidates:
    """Judge every checkpoint of run `run_id` and name the latest healthy one.

    Candidates come ranked: the recommended one, the other healthy ones (latest first),
    then the rejected ones (latest first); each with the reasons for its verdict.
    """
    config = config or run_config(session, run_id)
    alerts = run_alerts(session, run_id)
    onset = incident_onset(alerts, config=config)
    caveats = [CONFIGURATION_CAVEATS[rule] for rule in CONFIGURATION_CAVEATS
               if any(a.rule == rule and a.fired_step is not None for a in alerts)]  # fmt: skip
    if margin_steps is None:
        last_step = session.scalar(
            select(func.max(Step.step)).where(Step.run_id == run_id, Step.rank == config.rank)
        )
        margin_steps = margin_for(last_step, config=config)
    checkpoints = run_checkpoints(session, run_id, live=True).checkpoints
    first_bad = first_non_finite_loss(session, run_id, config.rank) if checkpoints else None
    judged = [
        (c, _judge(session, run_id, c, alerts, onset, margin_steps, config, first_bad))
        for c in checkpoints
    ]
    healthy = [(c, j) for c, j in judged if not j.failures]
    best = max(healthy, key=lambda cj: (cj[0].step or 0, cj[0].time), default=None)

    candidates = [
        _candidate(checkpoint, judgement, None if best is None else best[0], caveats)
        for checkpoint, judgement in judged
    ]
    order = {"recommended": 0, "healthy": 1, "rejected": 2}
    candidates.sort(
        key=lambda c: (order[c.verdict], -(c.step if c.step is not None else -1), -c.time)
    )
    recommended = (
        RestartCheckpoint(step=best[0].step, path=best[0].path, time=best[0].time)
        if best is not None
        else None
    )
    skip = None
    if best is not None and best[0].step is not None and onset is not None:
        after = config.skip_after_onset if config.skip_after_onset is not None else margin_steps
        skip = _data_skip(best[0].step, onset, after)
    return RestartCandidates(
        run_id=run_id,
        onset_step=onset.step if onset is not None else None,
        onset_rule=onset.rule if onset is not None else None,
        margin_steps=margin_steps,
        recommended=recommended,
        candidates=candidates,
        skip_steps=skip,
    )


def _candidate(
    checkpoint: CheckpointPublic,
    judgement: _Judgement,
    best: CheckpointPublic | None,
    caveats: list[str],
) -> RestartCandidate:
    """A judged checkpoint with its verdict and reasons; `best` the recommended one."""
    summary = ", ".join(judgement.notes)
    if judgement.failures:
        verdict, reasons = "rejected", judgement.failures
    elif best is not None and checkpoint is best:
        verdict, reasons = "recommended", [f"latest healthy checkpoint: {summary}"]
    else:
        assert best is not None
        verdict = "healthy"
        reasons = [
            f"healthy: {summary}",
            f"a later healthy checkpoint (step {best.step}) is recommended",
        ]
    return RestartCandidate(
        step=checkpoint.step,
        path=checkpoint.path,
        time=checkpoint.time,
        verdict=verdict,
        reasons=[*reasons, *caveats],
        loss_scale=encode_float(judgement.loss_scale),
        act_norm=encode_float(judgement.act_norm),
    )


def _data_skip(checkpoint_step: int, onset: Onset, after: int) -> DataSkip:
    """The batches to skip on a restart from the checkpoint at `checkpoint_step`."""
    return DataSkip(
        start=checkpoint_step + 1,
        end=onset.step + after,
        reason=(
            f"the batches from the checkpoint (step {checkpoint_step}) to {after} steps after "
            f"the incident onset at step {onset.step} ({onset.rule}): the data at and "
            "just before a spike is its likeliest trigger (PaLM skipped 200-500 batches)"
        ),
    )
