"""Runs are unique per (project, client_run_id), no longer by client_run_id alone.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

With a global key, two tenants whose agents chose the same client run id (from a job
name, say) raced into one run: the project check and the write were two transactions,
and the write found the run by client_run_id alone. Keyed per project, each tenant's
writes find or create only their own project's run, so the race and run-id squatting
are gone by construction. Downgrading fails if two projects now share a client run id.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint(op.f("uq_runs_client_run_id"), type_="unique")
        batch.create_unique_constraint(
            op.f("uq_runs_project_client_run_id"), ["project", "client_run_id"]
        )


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint(op.f("uq_runs_project_client_run_id"), type_="unique")
        batch.create_unique_constraint(op.f("uq_runs_client_run_id"), ["client_run_id"])
