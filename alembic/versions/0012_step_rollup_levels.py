"""`step_rollup_levels`: the step rollups at 256..65,536-step levels, above the 64-step
`step_rollups`.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01

A whole-run step series of a 2M-step run read ~31,000 64-step rollups (98 ms on SQLite);
from these levels it reads ~2,000 at any length (`ampwatch.server.rollups`). Existing runs
are backfilled here level by level, each from the one below, with the statement ingest
ran at this revision (`rollups.level_rows`), so that stored and freshly ingested levels
cannot differ.

A frozen snapshot: the step fields, levels and statement are spelled out as they were at
this revision, importing nothing from the package, so that a step field added later does
not change what this migration creates (tests/server/test_server_migrations.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

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
_EXTREMES = tuple(
    f"{field}_{extreme}" for field in _STEP_FLOAT_FIELDS for extreme in ("min", "max")
)
#: The rollup columns this revision backfills (`rollups.EXTREME_COLUMNS` then).
_COLUMNS = ("first_step", "last_step", "skipped_count", *_EXTREMES)
#: The levels written here, each from the one below (64 steps: the `step_rollups` table).
_LEVEL_FACTOR = 4
_LEVELS = (256, 1_024, 4_096, 16_384, 65_536)


def upgrade() -> None:
    op.create_table(
        "step_rollup_levels",
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("skipped_count", sa.Integer(), nullable=False),
        sa.Column("step_count", sa.Integer(), nullable=False, server_default="0"),
        *(sa.Column(name, sa.Double(), nullable=True) for name in _EXTREMES),
        sa.PrimaryKeyConstraint(
            "run_id", "rank", "level", "bucket_start", name=op.f("pk_step_rollup_levels")
        ),
    )
    _backfill()


def _backfill() -> None:
    """Each level's buckets from the level below's: minima of minima, maxima of maxima,
    sums of counts (the table is new, so a plain INSERT .. SELECT)."""
    for level in _LEVELS:
        below = level // _LEVEL_FACTOR
        source = _rollup_table("step_rollups" if below == 64 else "step_rollup_levels")
        bucket = (source.c.bucket_start // level) * level
        rows = (
            sa.select(
                source.c.run_id, source.c.rank, sa.literal(level, sa.Integer), bucket,
                *(_combined(source.c[name], name) for name in _COLUMNS),
                sa.func.sum(source.c.step_count),
            )
            .where(*([] if below == 64 else [source.c.level == below]))
            .group_by(source.c.run_id, source.c.rank, bucket)
        )  # fmt: skip
        target = _rollup_table("step_rollup_levels")
        key = ("run_id", "rank", "level", "bucket_start")
        op.execute(target.insert().from_select([*key, *_COLUMNS, "step_count"], rows))


def _rollup_table(name: str) -> sa.TableClause:
    integers = ("run_id", "rank", "level", "skipped_count", "step_count")
    big = ("bucket_start", "first_step", "last_step")
    return sa.table(
        name,
        *(sa.column(c, sa.Integer) for c in integers),
        *(sa.column(c, sa.BigInteger) for c in big),
        *(sa.column(c, sa.Double) for c in _EXTREMES),
    )


def _combined(column: sa.ColumnClause[object], name: str) -> sa.ColumnElement[object]:
    if name.endswith("_count"):
        return sa.func.sum(column)
    if name.endswith("_min") or name == "first_step":
        return sa.func.min(column)
    return sa.func.max(column)


def downgrade() -> None:
    op.drop_table("step_rollup_levels")
