"""Projects and API tokens; runs.project becomes a foreign key to projects.name.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29

Every project name already used by a run gets its project row, and so does `default`
(the project an agent reports to when none is configured), so existing data and direct
`ingest_batch` callers keep working. On SQLite the foreign key needs a rebuild of `runs`
(batch mode); `env.py` turns SQLite's foreign-key enforcement off for the migration
connection, so dropping the old `runs` table does not cascade into its children.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_PROJECT = "default"


def upgrade() -> None:
    projects = op.create_table(
        "projects",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_projects")),
        sa.UniqueConstraint("name", name=op.f("uq_projects_name")),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column(
            "project_id",
            sa.Integer(),
            sa.ForeignKey(
                "projects.id", ondelete="CASCADE", name=op.f("fk_tokens_project_id_projects")
            ),
            nullable=True,
        ),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tokens")),
        sa.UniqueConstraint("prefix", name=op.f("uq_tokens_prefix")),
    )
    op.create_index(op.f("ix_tokens_project_id"), "tokens", ["project_id"])

    bind = op.get_bind()
    names = set(bind.scalars(sa.text("SELECT DISTINCT project FROM runs"))) | {DEFAULT_PROJECT}
    now = datetime.now(timezone.utc)
    op.bulk_insert(projects, [{"name": name, "created_at": now} for name in sorted(names)])

    with op.batch_alter_table("runs") as batch:
        batch.create_foreign_key(
            op.f("fk_runs_project_projects"), "projects", ["project"], ["name"]
        )


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint(op.f("fk_runs_project_projects"), type_="foreignkey")
    op.drop_index(op.f("ix_tokens_project_id"), table_name="tokens")
    op.drop_table("tokens")
    op.drop_table("projects")
