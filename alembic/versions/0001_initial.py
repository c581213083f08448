"""Initial schema: runs, ingested batches, steps, layers, packed layer stats, events.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Column types are written as plain SQLAlchemy types, not the application's TypeDecorators
(`UTCDateTime`, `NonFiniteFloat`): those only convert values in Python, the DDL is the
same, and a migration must not change when application code does.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _run_fk() -> sa.Column[int]:
    return sa.Column(
        "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
    )


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("client_run_id", sa.String(length=512), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=False),
        sa.Column("project", sa.String(length=512), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_reason", sa.String(length=512), nullable=True),
        sa.CheckConstraint("status IN ('running', 'ended')", name=op.f("ck_runs_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("client_run_id", name=op.f("uq_runs_client_run_id")),
    )
    op.create_index(op.f("ix_runs_project"), "runs", ["project"])

    op.create_table(
        "ingested_batches",
        _run_fk(),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "seq", name=op.f("pk_ingested_batches")),
    )

    op.create_table(
        "steps",
        _run_fk(),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("loss", sa.Double(), nullable=True),
        sa.Column("loss_scale", sa.Double(), nullable=True),
        sa.Column("skipped", sa.Boolean(), nullable=False),
        sa.Column("grad_norm", sa.Double(), nullable=True),
        sa.Column("lr", sa.Double(), nullable=True),
        sa.Column("act_norm_mean", sa.Double(), nullable=True),
        sa.Column("act_norm_max", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "rank", "step", name=op.f("pk_steps")),
    )

    op.create_table(
        "layers",
        _run_fk(),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "idx", name=op.f("pk_layers")),
        sa.UniqueConstraint("run_id", "name", name=op.f("uq_layers_run_id_name")),
    )

    op.create_table(
        "layer_stats",
        _run_fk(),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("stat", sa.String(length=64), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("values", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "rank", "stat", "step", name=op.f("pk_layer_stats")),
    )

    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        _run_fk(),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index(op.f("ix_events_run_id_time"), "events", ["run_id", "time"])


def downgrade() -> None:
    op.drop_index(op.f("ix_events_run_id_time"), table_name="events")
    op.drop_table("events")
    op.drop_table("layer_stats")
    op.drop_table("layers")
    op.drop_table("steps")
    op.drop_table("ingested_batches")
    op.drop_index(op.f("ix_runs_project"), table_name="runs")
    op.drop_table("runs")
