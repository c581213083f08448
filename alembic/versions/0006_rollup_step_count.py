"""`step_rollups.step_count`: the step rows of each bucket, so that a run's step count and
recent skip rate come exactly from the rollups.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29

The runs list reads every run's step count and skip rate; from the raw steps that cost
60-200 ms for a 100k-step run, from the rollups ~2 ms. A bucket's span
(`last_step - first_step + 1`) overcounts where the agent dropped steps inside it, and
the dashboard must not hide an incomplete record, so the count is stored. Existing rows
are counted from `steps` once, here.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("step_rollups") as batch:
        batch.add_column(sa.Column("step_count", sa.Integer(), nullable=False, server_default="0"))
    # 63 = ROLLUP_WIDTH - 1: a bucket is the 64 steps from its bucket_start.
    op.execute(
        "UPDATE step_rollups SET step_count = (SELECT count(*) FROM steps"
        " WHERE steps.run_id = step_rollups.run_id AND steps.rank = step_rollups.rank"
        " AND steps.step BETWEEN step_rollups.bucket_start AND step_rollups.bucket_start + 63)"
    )


def downgrade() -> None:
    with op.batch_alter_table("step_rollups") as batch:
        batch.drop_column("step_count")
