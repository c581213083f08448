"""`step_rollup_levels`: the step rollups at 256..65,536-step levels, above the 64-step
`step_rollups`.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01

A whole-run step series of a 2M-step run read ~31,000 64-step rollups (98 ms on SQLite);
from these levels it reads ~2,000 at any length (`ampwatch.server.rollups`). Existing runs
are backfilled here level by level, each from the one below, with the statement ingest
runs, so that stored and freshly ingested levels cannot differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.orm import Session

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The step fields at this revision, frozen: the package's list grows with later
#: migrations (0016), which add their own columns to this table.
STEP_FLOAT_FIELDS = (
    "loss", "loss_scale", "grad_norm", "lr", "act_norm_mean", "act_norm_max",
    "grad_norm_clipped", "act_prenorm_mean", "act_prenorm_max",
)  # fmt: skip
#: The rollup columns this revision's backfill writes.
EXTREME_COLUMNS = (
    "first_step", "last_step", "skipped_count",
    *(f"{field}_{extreme}" for field in STEP_FLOAT_FIELDS for extreme in ("min", "max")),
)  # fmt: skip


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
        *(
            sa.Column(f"{field}_{extreme}", sa.Double(), nullable=True)
            for field in STEP_FLOAT_FIELDS
            for extreme in ("min", "max")
        ),
        sa.PrimaryKeyConstraint(
            "run_id", "rank", "level", "bucket_start", name=op.f("pk_step_rollup_levels")
        ),
    )
    _backfill()


def _backfill() -> None:
    from ampwatch.server.layer_rollups import LAYER_LEVELS
    from ampwatch.server.rollups import level_rows

    # A session only to build and run the statements in the migration's transaction,
    # which it joins and leaves to alembic to commit.
    with Session(bind=op.get_bind()) as session:
        for level in LAYER_LEVELS[1:]:
            session.execute(
                level_rows(session.get_bind().dialect.name, level, columns=EXTREME_COLUMNS)
            )


def downgrade() -> None:
    op.drop_table("step_rollup_levels")
