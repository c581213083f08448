"""`abandoned_steps`: the tail a resumed run abandoned, kept for the run page's rollback;
`runs.resumed_at`: when the latest resume was stored (the advisor's live branch).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02

`watch(resume_from=plan)` re-sends the steps after the plan's checkpoint, which would
overwrite the abandoned ones in `steps`; the collector moves them here at the `resumed`
event (`ampwatch.server.rollback`). A frozen snapshot of the columns: imports nothing from
the package. Runs resumed before this revision overwrote their tails and have no
`resumed_at`: nothing to backfill.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "abandoned_steps",
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("branch", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("from_step", sa.BigInteger(), nullable=False),
        sa.Column("skipped", sa.Boolean(), nullable=False),
        sa.Column("loss", sa.Double(), nullable=True),
        sa.Column("loss_scale", sa.Double(), nullable=True),
        sa.Column("grad_norm", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint(
            "run_id", "branch", "rank", "step", name=op.f("pk_abandoned_steps")
        ),
    )

    op.add_column("runs", sa.Column("resumed_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("resumed_at")
    op.drop_table("abandoned_steps")
