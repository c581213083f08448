"""`projects.alerts_version` and `runs.alerts_version`: alerts change counters, the ETags
of the alert lists (the alerts across a project's runs; a run's alerts page).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07

Every write of a run's alerts (the alert engine, a lead's stamp) bumps the run's in its
transaction, and the project's at its commit, as a run's deletion does
(`ampwatch.server.run_version`). Imports nothing from the package. Existing rows start at
0: a client holds no ETag of their lists yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


_TABLES = ("projects", "runs")


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column("alerts_version", sa.BigInteger(), server_default="0", nullable=False)
            )


def downgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("alerts_version")
