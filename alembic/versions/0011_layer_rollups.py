"""`layer_rollups`: per-layer maxima and minima of each layer statistic over 64..65,536-step
buckets, and `runs.layer_stats_aged_before`, the horizon of aged raw layer samples.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01

A whole-run heatmap or layer series read every raw row of the run (7 s extrapolated for a
2M-step x 1,000-tensor run); from these rows it reads ~2,000 at any length
(`ampwatch.server.layer_rollups`). Existing runs are backfilled here, one (run, rank,
statistic) at a time, with the module's own reduction, so that stored and freshly ingested
rollups cannot differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "layer_rollups",
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("stat", sa.String(length=64), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("maxima", sa.LargeBinary(), nullable=False),
        sa.Column("minima", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint(
            "run_id", "rank", "stat", "level", "bucket_start", name=op.f("pk_layer_rollups")
        ),
    )
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("layer_stats_aged_before", sa.BigInteger(), nullable=True))
    _backfill()


def _backfill() -> None:
    from ampwatch.server.layer_rollups import ROLLUP_COLUMNS, rollups_from_rows

    connection = op.get_bind()
    table = sa.table("layer_rollups", *(sa.column(c) for c in ROLLUP_COLUMNS))
    keys = connection.execute(
        sa.text("SELECT DISTINCT run_id, rank, stat FROM layer_stats ORDER BY run_id, rank, stat")
    ).all()
    for run_id, rank, stat in keys:
        rows = connection.execute(
            sa.text(
                'SELECT step, "values" FROM layer_stats WHERE run_id = :run AND rank = :rank'
                " AND stat = :stat ORDER BY step"
            ),
            {"run": run_id, "rank": rank, "stat": stat},
        )
        rollups = rollups_from_rows(run_id, rank, stat, ((r[0], r[1]) for r in rows))
        if rollups:
            connection.execute(table.insert(), [dict(zip(ROLLUP_COLUMNS, r)) for r in rollups])


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("layer_stats_aged_before")
    op.drop_table("layer_rollups")
