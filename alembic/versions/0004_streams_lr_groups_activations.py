"""Idempotency per sending process (`ingested_batches` keyed by (run, stream, seq));
the lr of every param group (`steps.lr_groups`); the leaf modules whose activation
max-abs is recorded (`modules`).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29

Every rank of a distributed run shares one client run id, and a run resumed from a
checkpoint reuses it; each of those agent processes numbers its batches from seq 0. Keyed
by (run, seq), rank 1's batches were acknowledged as duplicates of rank 0's and dropped.
The agent now sends a `stream` id per process; it joins the key. Rows stored before this
revision get the empty stream (no agent sends one: the field is required and non-empty).

SQLite cannot change a primary key in place, so batch mode recreates the table; nothing
refers to `ingested_batches`, so the recreation cascades nowhere.

`steps.lr_groups` is a packed little-endian float64 array (as `layer_stats.values`), NULL
for steps with one param group: one nullable column, no row per group, since it is read
only with its step.

`modules` numbers a run's leaf modules as `layers` numbers its parameter tensors: the
activation statistic's packed `layer_stats` rows index it, so they reuse the layer-stat
storage and reads, while parameter matrices keep their own columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("steps", sa.Column("lr_groups", sa.LargeBinary(), nullable=True))
    op.create_table(
        "modules",
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "idx", name=op.f("pk_modules")),
        sa.UniqueConstraint("run_id", "name", name=op.f("uq_modules_run_id_name")),
    )
    with op.batch_alter_table("ingested_batches", recreate="auto") as batch:
        batch.add_column(
            sa.Column("stream", sa.String(64), nullable=False, server_default=""),
        )
        batch.drop_constraint("pk_ingested_batches", type_="primary")
        batch.create_primary_key("pk_ingested_batches", ["run_id", "stream", "seq"])


def downgrade() -> None:
    op.execute("DELETE FROM layer_stats WHERE stat = 'activation_max_abs'")
    op.drop_table("modules")
    # (run, seq) must be unique again: keep one row per (run, seq), the smallest stream.
    op.execute(
        "DELETE FROM ingested_batches WHERE EXISTS (SELECT 1 FROM ingested_batches AS o "
        "WHERE o.run_id = ingested_batches.run_id AND o.seq = ingested_batches.seq "
        "AND o.stream < ingested_batches.stream)"
    )
    with op.batch_alter_table("ingested_batches", recreate="auto") as batch:
        batch.drop_constraint("pk_ingested_batches", type_="primary")
        batch.drop_column("stream")
        batch.create_primary_key("pk_ingested_batches", ["run_id", "seq"])
    # Plain DROP COLUMN (SQLite >= 3.35), not batch mode: nothing to recreate.
    op.drop_column("steps", "lr_groups")
