"""Exponent histograms per layer and step, step rollups, per-run counts of dropped records.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

`layer_histograms` keeps one row per (run, rank, layer, step): the dashboard asks for one
layer's histogram at a step or over a range of steps, which the primary key serves as one
range scan, and a histogram row is already an array (the non-empty span of 256 exponent
bins, packed little-endian int64), so there is no per-value row to avoid.

`step_rollups` holds min/max of every step field per 64-step bucket, so a downsampled
series of a long run reads ~1/64 of the rows (see `ampwatch.server.step_models.StepRollup`).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DROPPED_COLUMNS = ("dropped_steps", "dropped_layer_stats", "dropped_events")
STEP_FLOAT_FIELDS = ("loss", "loss_scale", "grad_norm", "lr", "act_norm_mean", "act_norm_max")


def upgrade() -> None:
    for name in DROPPED_COLUMNS:
        op.add_column("runs", sa.Column(name, sa.BigInteger(), nullable=False, server_default="0"))
    op.create_table(
        "layer_histograms",
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("layer_idx", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("first_bin", sa.SmallInteger(), nullable=False),
        sa.Column("counts", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint(
            "run_id", "rank", "layer_idx", "step", name=op.f("pk_layer_histograms")
        ),
    )

    op.create_table(
        "step_rollups",
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("skipped_count", sa.Integer(), nullable=False),
        *(
            sa.Column(f"{field}_{extreme}", sa.Double(), nullable=True)
            for field in STEP_FLOAT_FIELDS
            for extreme in ("min", "max")
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", "bucket_start", name=op.f("pk_step_rollups")),
    )
    if op.get_bind().dialect.name == "postgresql":
        # Out-of-line and uncompressed: one layer's series reads 8 bytes of each packed row
        # (substr), which PostgreSQL can fetch without de-TOASTing the whole row only when
        # the value is not compressed.
        op.execute('ALTER TABLE layer_stats ALTER COLUMN "values" SET STORAGE EXTERNAL')


def downgrade() -> None:
    op.drop_table("step_rollups")
    op.drop_table("layer_histograms")
    # Plain DROP COLUMN (SQLite >= 3.35), not batch mode: recreating `runs` with foreign
    # keys on would cascade-delete every run's data.
    for name in reversed(DROPPED_COLUMNS):
        op.drop_column("runs", name)
