"""One layer's exponent histograms and a run's checkpoints: the restart advisor's inputs."""

from __future__ import annotations

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import encode_float
from ampwatch.server.layer_models import LayerHistogram
from ampwatch.server.models import Event
from ampwatch.server.schemas.runs import CheckpointPublic, CheckpointsPublic, LayerHistograms
from ampwatch.server.step_models import Step


def layer_histograms(
    session: Session,
    run_id: int,
    layer: str,
    idx: int,
    rank: int,
    *,
    start: int | None = None,
    end: int | None = None,
    max_points: int,
) -> LayerHistograms:
    """The layer's histograms at steps in [start, end], evenly thinned to <= max_points.

    Thinned, not merged: a histogram summed over steps would blur exactly the drift toward
    the underflow range that a reader compares step against step.
    """
    conditions = [
        LayerHistogram.run_id == run_id,
        LayerHistogram.rank == rank,
        LayerHistogram.layer_idx == idx,
    ]
    if start is not None:
        conditions.append(LayerHistogram.step >= start)
    if end is not None:
        conditions.append(LayerHistogram.step <= end)
    rows = session.execute(
        select(LayerHistogram.step, LayerHistogram.first_bin, LayerHistogram.counts)
        .where(*conditions)
        .order_by(LayerHistogram.step)
    ).all()
    rows = rows[:: -(-len(rows) // max_points)] if len(rows) > max_points else rows
    scales = _loss_scales(session, run_id, rank, [step for step, _, _ in rows])
    return LayerHistograms.model_construct(
        layer=layer,
        rank=rank,
        steps=[step for step, _, _ in rows],
        offsets=[first_bin for _, first_bin, _ in rows],
        counts=[np.frombuffer(counts, dtype="<i8").tolist() for _, _, counts in rows],
        loss_scale=[encode_float(scales.get(step)) for step, _, _ in rows],
    )


def _loss_scales(session: Session, run_id: int, rank: int, steps: list[int]) -> dict[int, float]:
    """The loss scale of each of `steps`, from the step records: the rank's own where it
    sent them, else the lowest rank's (rank 0 sends the step scalars; ranks share one
    scaler)."""
    if not steps:
        return {}
    rows = session.execute(
        select(Step.step, Step.rank, Step.loss_scale)
        .where(Step.run_id == run_id, Step.step.in_(steps), Step.loss_scale.is_not(None))
        .order_by(Step.step, Step.rank)
    )
    scales: dict[int, float] = {}
    for step, step_rank, scale in rows:
        if scale is not None and (step not in scales or step_rank == rank):
            scales[step] = scale
    return scales


def run_checkpoints(session: Session, run_id: int, *, live: bool = False) -> CheckpointsPublic:
    """The run's `checkpoint` events in time order. `live`: without those of abandoned
    branches, i.e. saved after the step a later `resumed` event rolled back to (stored
    before it: event ids only grow), whose weights the resumed run left behind.

    >>> [c.step for c in run_checkpoints(session, run.id, live=True).checkpoints]  # doctest: +SKIP
    [10, 20, 30]
    """
    events = session.scalars(
        select(Event)
        .where(Event.run_id == run_id, Event.kind.in_(("checkpoint", "resumed")))
        .order_by(Event.time, Event.id)
    ).all()
    resumes = [(e.id, e.step) for e in events if e.kind == "resumed" and e.step is not None]
    return CheckpointsPublic(
        checkpoints=[
            CheckpointPublic(
                step=event.step,
                time=event.time.timestamp(),
                path=str(event.data["path"]) if event.data.get("path") is not None else None,
                data=event.data,
            )
            for event in events
            if event.kind == "checkpoint" and not (live and _abandoned(event, resumes))
        ]
    )


def _abandoned(checkpoint: Event, resumes: list[tuple[int, int]]) -> bool:
    step = checkpoint.step
    return step is not None and any(checkpoint.id < id_ and step > to for id_, to in resumes)
