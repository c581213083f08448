"""`steps.act_prenorm_mean` / `act_prenorm_max` and their rollup extremes: the activation
norm of the final norm's input.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

`act_norm_*` is measured where the head reads the final hidden state, after the final
LayerNorm, which holds a divergence down; the last block's output before
that norm is stored besides it. Existing rows were never measured: NULL.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_STEP_COLUMNS = ("act_prenorm_mean", "act_prenorm_max")
_ROLLUP_COLUMNS = tuple(f"{c}_{extreme}" for c in _STEP_COLUMNS for extreme in ("min", "max"))


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        for name in _STEP_COLUMNS:
            batch.add_column(sa.Column(name, sa.Double(), nullable=True))
    with op.batch_alter_table("step_rollups") as batch:
        for name in _ROLLUP_COLUMNS:
            batch.add_column(sa.Column(name, sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("step_rollups") as batch:
        for name in reversed(_ROLLUP_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("steps") as batch:
        for name in reversed(_STEP_COLUMNS):
            batch.drop_column(name)
