"""`tokens.scope`: what a token may do in its project (write, read, or only `/metrics`);
`run_step_totals`: each (run, rank)'s steps, skipped steps and last step.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

Every token made before this revision could write, so existing rows become `write`
(the server default): nothing that worked stops working. The totals of existing runs
are summed from their step rollups once, here; ingest keeps them from then on.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(
            sa.Column("scope", sa.String(length=16), nullable=False, server_default="write")
        )
        batch.create_check_constraint(
            op.f("ck_tokens_scope"), "scope IN ('write', 'read', 'metrics')"
        )
    op.create_table(
        "run_step_totals",
        sa.Column(
            "run_id",
            sa.Integer(),
            sa.ForeignKey(
                "runs.id", ondelete="CASCADE", name=op.f("fk_run_step_totals_run_id_runs")
            ),
            nullable=False,
        ),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("steps", sa.BigInteger(), nullable=False),
        sa.Column("skipped_steps", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "rank", name=op.f("pk_run_step_totals")),
    )
    op.execute(
        "INSERT INTO run_step_totals (run_id, rank, steps, skipped_steps, last_step)"
        " SELECT run_id, rank, sum(step_count), sum(skipped_count), max(last_step)"
        " FROM step_rollups GROUP BY run_id, rank"
    )


def downgrade() -> None:
    op.drop_table("run_step_totals")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_constraint(op.f("ck_tokens_scope"), type_="check")
        batch.drop_column("scope")
