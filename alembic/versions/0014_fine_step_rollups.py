"""The 16-step level of the step rollups (`rollups.FINE_LEVEL`), in `step_rollup_levels`.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01

A zoomed window of 16,000-64,000 steps was under the 64-step level and read its raw
steps; it now reads these. No schema change: existing runs are backfilled from their raw
steps with the statement ingest runs, so that stored and freshly ingested rows cannot
differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.orm import Session

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LEVEL = 16


def upgrade() -> None:
    from ampwatch.server.rollups import fine_rows

    # The rollup columns at this revision, frozen (0016 adds more, after this backfill).
    fields = (
        "loss", "loss_scale", "grad_norm", "lr", "act_norm_mean", "act_norm_max",
        "grad_norm_clipped", "act_prenorm_mean", "act_prenorm_max",
    )  # fmt: skip
    columns = (
        "first_step", "last_step", "skipped_count",
        *(f"{field}_{extreme}" for field in fields for extreme in ("min", "max")),
        "act_threshold_min", "act_threshold_max", "act_above_count",
    )  # fmt: skip
    # A session only to build and run the statement in the migration's transaction.
    with Session(bind=op.get_bind()) as session:
        session.execute(fine_rows(session.get_bind().dialect.name, columns=columns))


def downgrade() -> None:
    levels = sa.table("step_rollup_levels", sa.column("level"))
    op.execute(sa.delete(levels).where(levels.c.level == _LEVEL))
