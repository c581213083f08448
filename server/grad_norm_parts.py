"""A sharded step's global grad norm, combined at ingest from its ranks' parts.

Under FSDP2 / FSDP1 without a clip, every rank sends its part of a step's squared global
grad norm (`grad_sumsq`, `grad_parts` = the world size); the ranks' batches arrive in any
order and any grouping. Each part is stored (`grad_norm_parts`), and the batch that brings a
step's last missing part writes `grad_norm` = sqrt(sum of all parts) on the step's rank-0
row: into the batch's own rank-0 record when it carries that step (before the rule engine
reads it), else as an update of the stored row (its rollups refreshed). The sum is
`math.fsum`, exactly rounded, so the norm is the same bit for bit whatever the order, and
recomputing it on a re-sent part is idempotent; a step whose parts never all arrive keeps a
NULL norm. The rule engine reads a rank-0 record when its batch is stored
(`alerts.evaluate`); a norm completed by a later batch of another rank is handed to it with
that batch (`late_norms`), so `grad_norm_spike` judges it either way.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Table, bindparam, func, select, update
from sqlalchemy.orm import Session

from ampwatch.agent.wire import decode_float, encode_float
from ampwatch.server.alerts.spikes import LateNorm
from ampwatch.server.column_types import sqlite_float
from ampwatch.server.db import upsert
from ampwatch.server.rollups import refresh_step_rollups
from ampwatch.server.schemas.wire import StepIn
from ampwatch.server.step_models import GradNormPart, Step

_PART_COLUMNS = ("run_id", "step", "rank", "sumsq", "parts")
_PART_KEY = ("run_id", "step", "rank")
#: The row that receives a step's combined grad norm: the lowest rank, which the rule
#: engine follows (the parts of a step come from ranks 0..grad_parts-1).
_NORM_RANK = 0


def combined_norm(parts: list[float]) -> float:
    """sqrt of the sum of the parts (`math.fsum`: exactly rounded, so independent of their
    order); a NaN part makes it NaN, an infinite one Inf, as the loop's own norm would be.

    >>> combined_norm([9.0, 16.0]), combined_norm([1.0, math.inf]), combined_norm([1.0, math.nan])
    (5.0, inf, nan)
    """
    if any(math.isnan(p) for p in parts):
        return math.nan
    if any(math.isinf(p) for p in parts):
        return math.inf
    return math.sqrt(math.fsum(parts))


def combine_grad_norms(session: Session, run_id: int, steps: list[StepIn]) -> list[LateNorm]:
    """Store the batch's grad-norm parts; give every step they complete its norm (the module
    docstring). Reads the parts of the batch's steps only: (steps x world size) rows.
    Returns the norms written into rows stored by earlier batches, for the rule engine."""
    sqlite = session.get_bind().dialect.name == "sqlite"
    bind = sqlite_float if sqlite else decode_float
    latest: dict[tuple[int, int], tuple[Any, ...]] = {}
    for record in steps:
        if record.grad_sumsq is not None:
            key = (record.step, record.rank)
            latest[key] = (run_id, *key, bind(record.grad_sumsq), record.grad_parts)
    if not latest:
        return []
    upsert(session, GradNormPart, _PART_COLUMNS, list(latest.values()), _PART_KEY)
    touched = {step for step, _ in latest}
    part = GradNormPart
    in_range = (part.run_id == run_id, part.step.between(min(touched), max(touched)))
    complete = session.execute(
        select(part.step)
        .where(*in_range)
        .group_by(part.step)
        .having(func.count() == func.min(part.parts), func.min(part.parts) == func.max(part.parts))
    ).scalars()
    done = touched.intersection(complete)
    if not done:
        return []
    sums: dict[int, list[float]] = {}
    for step, sumsq in session.execute(select(part.step, part.sumsq).where(*in_range)):
        if step in done:
            sums.setdefault(step, []).append(sumsq)
    norms = {step: combined_norm(parts) for step, parts in sums.items()}
    stored = set(norms)
    for record in steps:
        if record.rank == _NORM_RANK and record.step in norms:
            record.grad_norm = encode_float(norms[record.step])  # stored and judged with it
            stored.discard(record.step)
    if not stored:
        return []
    rows = session.execute(
        select(Step.step, Step.skipped).where(
            Step.run_id == run_id, Step.rank == _NORM_RANK, Step.step.in_(sorted(stored))
        )
    )
    skipped = {step: bool(flag) for step, flag in rows}  # rank 0's rows stored earlier
    earlier = sorted(skipped)
    if not earlier:
        return []
    table = Step.__table__
    assert isinstance(table, Table)  # a mapped class's table, not a select
    statement = (
        update(table)
        .where(table.c.run_id == run_id, table.c.rank == _NORM_RANK, table.c.step == bindparam("s"))
        .values(grad_norm=bindparam("g", type_=table.c.grad_norm.type))
    )
    session.connection().execute(statement, [{"s": s, "g": norms[s]} for s in earlier])
    refresh_step_rollups(session, run_id, [(_NORM_RANK, a, b) for a, b in _runs(earlier)])
    return [(_NORM_RANK, s, norms[s], skipped[s]) for s in earlier]


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    """Sorted steps as (first, last) runs of consecutive steps.

    >>> _runs([1, 2, 3, 7, 9, 10])
    [(1, 3), (7, 7), (9, 10)]
    """
    runs: list[tuple[int, int]] = []
    for step in steps:
        if runs and runs[-1][1] == step - 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    return runs
