"""`projects.alerts_version`: a project's alerts change counter, the ETag of its alert
lists (the alerts across its runs, and each run's alerts page).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07

Every write of an alert of the project's runs (the alert engine, a lead's stamp, a run's
deletion) bumps it at its transaction's commit (`ampwatch.server.run_version`). Imports
nothing from the package. Existing projects start at 0: a client holds no ETag of their
lists yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("projects") as batch:
        batch.add_column(
            sa.Column("alerts_version", sa.BigInteger(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("projects") as batch:
        batch.drop_column("alerts_version")
