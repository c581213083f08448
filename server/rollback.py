"""A resumed run's rollback: the abandoned tail kept apart from the live branch.

`watch(resume_from=plan)` continues the same run id from the plan's checkpoint step and
re-sends every step after it; a step row is keyed (run, rank, step), so the new branch
would overwrite the abandoned one step by step, and until it caught up the charts would
draw the old tail as if it were live. So when the `resumed` event is stored, the steps
after its `from_step` move, in the batch's transaction, from `steps` to `abandoned_steps`
(numbered by `branch`, the run's resume count): `steps`, its rollups and the run's totals
then hold the live branch only, and every existing reader (series, runs list, metrics,
advisor) is right without knowing about resumes; `abandoned_tails` serves the old tail to
the run page, which greys it.

Why a move, not a branch column on `steps`: a key change of the largest table, its
rollups and every query over it, for a tail the charts read in one place.

Only the step fields the rollback is drawn with (loss, loss scale, grad norm,
skipped) are kept; layer statistics of the tail stay in place and are overwritten as the
new branch reaches them. The move costs one INSERT .. SELECT and one DELETE over the tail
(a resume is rare; the tail is what ran since the plan's checkpoint). The `resumed` event
comes from rank 0's new process before its first step, so it is stored before the new
branch's steps of that stream (batches of a stream are delivered in order).
"""

from __future__ import annotations

from sqlalchemy import delete, func, insert, literal, select
from sqlalchemy.orm import Session

from ampwatch.agent.wire import encode_float
from ampwatch.server.rollups import refresh_step_rollups
from ampwatch.server.schemas.runs import AbandonedTail, AbandonedTails
from ampwatch.server.step_models import AbandonedStep, GradNormPart, Step

#: Abandoned steps one answer holds at most (newest resume first); the rest are counted.
MAX_ABANDONED_STEPS = 20_000

_KEPT = ("skipped", "loss", "loss_scale", "grad_norm")


def retire_abandoned_steps(session: Session, run_id: int, from_step: int) -> int:
    """Move the run's steps after `from_step` (every rank) to `abandoned_steps` as its next
    branch, drop their grad-norm parts, and recompute the rollups and totals they touched;
    returns the steps moved. The caller holds the run's lock (ingest).

    >>> retire_abandoned_steps(session, run.id, 20)  # doctest: +SKIP
    39
    """
    after = (Step.run_id == run_id, Step.step > from_step)
    spans = session.execute(
        select(Step.rank, func.min(Step.step), func.max(Step.step), func.count())
        .where(*after)
        .group_by(Step.rank)
    ).all()
    if not spans:
        return 0
    branch = (
        session.scalar(
            select(func.coalesce(func.max(AbandonedStep.branch), 0)).where(
                AbandonedStep.run_id == run_id
            )
        )
        or 0
    ) + 1
    rows = select(
        Step.run_id,
        literal(branch),
        Step.rank,
        Step.step,
        literal(from_step),
        *(getattr(Step, name) for name in _KEPT),
    ).where(*after)
    session.execute(
        insert(AbandonedStep).from_select(
            ["run_id", "branch", "rank", "step", "from_step", *_KEPT], rows
        )
    )
    session.execute(delete(Step).where(*after))
    session.execute(
        delete(GradNormPart).where(GradNormPart.run_id == run_id, GradNormPart.step > from_step)
    )
    refresh_step_rollups(
        session, run_id, [(rank, first, last) for rank, first, last, _ in spans], deleted=True
    )
    return sum(int(count) for *_, count in spans)


def abandoned_tails(session: Session, run_id: int, rank: int) -> AbandonedTails:
    """`rank`'s abandoned tails, one per resume that abandoned steps, oldest first, each
    ordered by step; floats in the wire encoding. At most `MAX_ABANDONED_STEPS` steps, the
    newest resumes' first (`left_off`: how many were not sent)."""
    where = (AbandonedStep.run_id == run_id, AbandonedStep.rank == rank)
    total = session.scalar(select(func.count()).where(*where)) or 0
    rows = session.execute(
        select(
            AbandonedStep.branch,
            AbandonedStep.from_step,
            AbandonedStep.step,
            *(getattr(AbandonedStep, name) for name in _KEPT),
        )
        .where(*where)
        .order_by(AbandonedStep.branch.desc(), AbandonedStep.step)
        .limit(MAX_ABANDONED_STEPS)
    ).all()
    tails: dict[int, AbandonedTail] = {}
    for branch, from_step, step, skipped, loss, loss_scale, grad_norm in rows:
        tail = tails.get(branch)
        if tail is None:
            tail = tails[branch] = AbandonedTail.model_construct(
                branch=branch, from_step=from_step, step=[], skipped=[], loss=[],
                loss_scale=[], grad_norm=[],
            )  # fmt: skip
        tail.step.append(step)
        tail.skipped.append(bool(skipped))
        tail.loss.append(encode_float(loss))
        tail.loss_scale.append(encode_float(loss_scale))
        tail.grad_norm.append(encode_float(grad_norm))
    return AbandonedTails.model_construct(
        tails=[tails[branch] for branch in sorted(tails)], left_off=total - len(rows)
    )
