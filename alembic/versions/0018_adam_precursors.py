"""`steps.adam_rms_max` / `update_ratio_max` and their rollup extremes: precursors of a
divergence read from an Adam-family optimizer's state every step (`agent/precursors.py`).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02

Existing rows were never measured: NULL. A frozen list of the columns: imports nothing
from the package.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_STEP_COLUMNS = ("adam_rms_max", "update_ratio_max")
_ROLLUP_COLUMNS = tuple(f"{c}_{extreme}" for c in _STEP_COLUMNS for extreme in ("min", "max"))
_ROLLUP_TABLES = ("step_rollups", "step_rollup_levels")


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        for name in _STEP_COLUMNS:
            batch.add_column(sa.Column(name, sa.Double(), nullable=True))
    for table in _ROLLUP_TABLES:
        with op.batch_alter_table(table) as batch:
            for name in _ROLLUP_COLUMNS:
                batch.add_column(sa.Column(name, sa.Double(), nullable=True))


def downgrade() -> None:
    for table in reversed(_ROLLUP_TABLES):
        with op.batch_alter_table(table) as batch:
            for name in reversed(_ROLLUP_COLUMNS):
                batch.drop_column(name)
    with op.batch_alter_table("steps") as batch:
        for name in reversed(_STEP_COLUMNS):
            batch.drop_column(name)
