"""`steps.grad_norm_clipped` and its rollup extremes: the grad norm after the loop's clip.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

`steps.grad_norm` is the norm before clipping (what `clip_grad_norm_` returned), so that a
gradient spike is not stored as the threshold; the norm the optimizer actually applied is
stored besides it. Existing rows were never measured: NULL.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ROLLUP_COLUMNS = ("grad_norm_clipped_min", "grad_norm_clipped_max")


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("grad_norm_clipped", sa.Double(), nullable=True))
    with op.batch_alter_table("step_rollups") as batch:
        for name in _ROLLUP_COLUMNS:
            batch.add_column(sa.Column(name, sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("step_rollups") as batch:
        for name in reversed(_ROLLUP_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("grad_norm_clipped")
