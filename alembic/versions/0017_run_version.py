"""`runs.version`: a run's change counter, the ETag of its read answers.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02

Every write that changes what a run's read endpoints answer bumps it
(`ampwatch.server.run_version`), so a poll of an unchanged run is a 304 without its query.
Imports nothing from the package. Existing runs start at 0: a client holds no ETag of
them yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("version", sa.BigInteger(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("version")
