"""The 16-step level of the step rollups (`rollups.FINE_LEVEL`), in `step_rollup_levels`.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01

A zoomed window of 16,000-64,000 steps was under the 64-step level and read its raw
steps; it now reads these. No schema change: existing runs are backfilled from their raw
steps with the statement ingest ran at this revision (`rollups.fine_rows`), so that
stored and freshly ingested rows cannot differ.

A frozen snapshot: the step fields and the statement are spelled out as they were at this
revision, importing nothing from the package (tests/server/test_server_migrations.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LEVEL = 16
#: The wire's `STEP_FLOAT_FIELDS` at this revision; each has a min and a max column.
_STEP_FLOAT_FIELDS = (
    "loss",
    "loss_scale",
    "grad_norm",
    "lr",
    "act_norm_mean",
    "act_norm_max",
    "grad_norm_clipped",
    "act_prenorm_mean",
    "act_prenorm_max",
)
#: The rollup columns at this revision (`rollups.ROLLUP_COLUMNS` then), in table order.
_COLUMNS = (
    "first_step",
    "last_step",
    "skipped_count",
    *(f"{field}_{extreme}" for field in _STEP_FLOAT_FIELDS for extreme in ("min", "max")),
    "act_threshold_min",
    "act_threshold_max",
    "act_above_count",
)


def upgrade() -> None:
    """The 16-step rollups of every raw step (none exist before this revision)."""
    steps = sa.table(
        "steps",
        sa.column("run_id", sa.Integer),
        sa.column("rank", sa.Integer),
        sa.column("step", sa.BigInteger),
        sa.column("skipped", sa.Boolean),
        sa.column("act_above", sa.Boolean),
        *(sa.column(field, sa.Double) for field in (*_STEP_FLOAT_FIELDS, "act_threshold")),
    )
    bucket = (steps.c.step // _LEVEL) * _LEVEL
    rows = (
        sa.select(
            steps.c.run_id, steps.c.rank, sa.literal(_LEVEL, sa.Integer), bucket,
            *(_aggregate(steps, name) for name in _COLUMNS), sa.func.count(),
        )
        .group_by(steps.c.run_id, steps.c.rank, bucket)
    )  # fmt: skip
    levels = sa.table(
        "step_rollup_levels",
        *(sa.column(c) for c in ("run_id", "rank", "level", "bucket_start", *_COLUMNS)),
        sa.column("step_count"),
    )
    key = ["run_id", "rank", "level", "bucket_start"]
    op.execute(levels.insert().from_select([*key, *_COLUMNS, "step_count"], rows))


def _aggregate(steps: sa.TableClause, name: str) -> sa.ColumnElement[object]:
    """`name`'s aggregate over raw steps (`rollups._raw_aggregate` at this revision)."""
    if name in ("first_step", "last_step"):
        return (sa.func.min if name == "first_step" else sa.func.max)(steps.c.step)
    if name.endswith("_count"):
        flag = steps.c.skipped if name == "skipped_count" else steps.c.act_above.is_(True)
        return sa.func.sum(sa.case((flag, 1), else_=0), type_=sa.Integer)
    field, extreme = name.rsplit("_", 1)
    return (sa.func.min if extreme == "min" else sa.func.max)(steps.c[field])


def downgrade() -> None:
    levels = sa.table("step_rollup_levels", sa.column("level"))
    op.execute(sa.delete(levels).where(levels.c.level == _LEVEL))
