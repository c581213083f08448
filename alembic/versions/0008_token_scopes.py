"""`tokens.scope`: what a token may do in its project (write, read, or only `/metrics`).

Revision ID: 0008
Revises: 0006
Create Date: 2026-12-01

Every token made before this revision could write, so existing rows become `write`
(the server default): nothing that worked stops working.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(
            sa.Column("scope", sa.String(length=16), nullable=False, server_default="write")
        )
        batch.create_check_constraint(
            op.f("ck_tokens_scope"), "scope IN ('write', 'read', 'metrics')"
        )


def downgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.drop_constraint(op.f("ck_tokens_scope"), type_="check")
        batch.drop_column("scope")
