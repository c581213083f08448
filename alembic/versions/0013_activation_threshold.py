"""`steps.act_threshold` / `act_above` and their rollup columns: `activation_norm_spike`'s
own firing threshold per step, which the activation-norm chart draws.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01

The rule engine writes them at ingest (`ampwatch.server.ingest`). Existing steps were
judged without storing it: NULL threshold, no step above, at every rollup level alike, so
no backfill is needed for the levels to agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ROLLUP_TABLES = ("step_rollups", "step_rollup_levels")


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("act_threshold", sa.Double(), nullable=True))
        batch.add_column(sa.Column("act_above", sa.Boolean(), nullable=True))
    for table in _ROLLUP_TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("act_threshold_min", sa.Double(), nullable=True))
            batch.add_column(sa.Column("act_threshold_max", sa.Double(), nullable=True))
            batch.add_column(
                sa.Column("act_above_count", sa.Integer(), nullable=False, server_default="0")
            )


def downgrade() -> None:
    for table in reversed(_ROLLUP_TABLES):
        with op.batch_alter_table(table) as batch:
            for name in ("act_above_count", "act_threshold_max", "act_threshold_min"):
                batch.drop_column(name)
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("act_above")
        batch.drop_column("act_threshold")
