"""`grad_norm_parts`: each rank's part of a sharded step's global grad norm.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02

Under FSDP2 / FSDP1 a loop that does not clip has no global grad norm on any rank, and the
agent never runs a collective: every rank sends the sum of squares of its shards
(`grad_sumsq`, `grad_parts`) and the collector adds them up into `steps.grad_norm`
(`ampwatch.server.ingest`). A frozen snapshot of the columns: imports nothing from the
package. Existing runs sent no parts: nothing to backfill.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "grad_norm_parts",
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("sumsq", sa.Double(), nullable=False),
        sa.Column("parts", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "step", "rank", name=op.f("pk_grad_norm_parts")),
    )


def downgrade() -> None:
    op.drop_table("grad_norm_parts")
