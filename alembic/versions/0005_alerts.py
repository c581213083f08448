"""Alerts, their evaluators' state, threshold overrides, webhooks and notifications;
`runs.health`.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29

Alert state lives in the database (`alert_state`), not in a collector process, so several
workers behind one PostgreSQL evaluate a run's batches as one engine would: ingest holds
the run's row lock while it evaluates. The partial unique index on open alerts makes the
per-(run, rule, layer) dedupe a constraint. `notifications` is an outbox written in the
same transaction as the alert transition it announces, and the delivery log afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OPEN_ALERT = "status IN ('pending', 'firing')"


def _time(name: str, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _run_id(nullable: bool = False, unique: bool = False) -> sa.Column[Any]:
    return sa.Column(
        "run_id",
        sa.Integer(),
        sa.ForeignKey("runs.id", ondelete="CASCADE"),
        nullable=nullable,
        unique=unique,
    )


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("health", sa.String(16), nullable=False, server_default="ok"))
    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer(), primary_key=True),
        _run_id(),
        sa.Column("rule", sa.String(64), nullable=False),
        sa.Column("layer", sa.String(512), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started_step", sa.BigInteger(), nullable=False),
        sa.Column("fired_step", sa.BigInteger(), nullable=True),
        sa.Column("resolved_step", sa.BigInteger(), nullable=True),
        _time("started_at"),
        _time("fired_at", nullable=True),
        _time("resolved_at", nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.CheckConstraint(
            "status IN ('pending', 'firing', 'resolved')", name=op.f("ck_alerts_status")
        ),
        sa.CheckConstraint(
            "severity IN ('info', 'warning', 'critical')", name=op.f("ck_alerts_severity")
        ),
    )
    op.create_index(
        "uq_alerts_open",
        "alerts",
        ["run_id", "rule", "layer"],
        unique=True,
        sqlite_where=sa.text(OPEN_ALERT),
        postgresql_where=sa.text(OPEN_ALERT),
    )
    op.create_index(op.f("ix_alerts_run_id_status"), "alerts", ["run_id", "status"])
    op.create_table(
        "alert_state",
        _run_id(),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        _time("updated_at"),
        sa.PrimaryKeyConstraint("run_id", "key", name=op.f("pk_alert_state")),
    )
    op.create_table(
        "alert_configs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "project",
            sa.String(512),
            sa.ForeignKey("projects.name", ondelete="CASCADE"),
            nullable=True,
            unique=True,
        ),
        _run_id(nullable=True, unique=True),
        sa.Column("rules", sa.JSON(), nullable=False),
        _time("updated_at"),
        sa.CheckConstraint(
            "(project IS NULL) <> (run_id IS NULL)", name=op.f("ck_alert_configs_one_scope")
        ),
    )
    op.create_table(
        "webhooks",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "project",
            sa.String(512),
            sa.ForeignKey("projects.name", ondelete="CASCADE"),
            nullable=True,
        ),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("min_severity", sa.String(16), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        _time("created_at"),
        sa.CheckConstraint("format IN ('slack', 'generic')", name=op.f("ck_webhooks_format")),
        sa.CheckConstraint(
            "min_severity IN ('info', 'warning', 'critical')",
            name=op.f("ck_webhooks_min_severity"),
        ),
    )
    op.create_index(op.f("ix_webhooks_project"), "webhooks", ["project"])
    op.create_table(
        "notifications",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "alert_id",
            sa.Integer(),
            sa.ForeignKey("alerts.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column(
            "webhook_id",
            sa.Integer(),
            sa.ForeignKey("webhooks.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("transition", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        _time("next_attempt_at"),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("response_status", sa.Integer(), nullable=True),
        _time("created_at"),
        _time("delivered_at", nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'delivered', 'failed')", name=op.f("ck_notifications_status")
        ),
        sa.CheckConstraint(
            "transition IN ('firing', 'resolved')", name=op.f("ck_notifications_transition")
        ),
    )
    op.create_index(op.f("ix_notifications_alert_id"), "notifications", ["alert_id"])
    op.create_index(op.f("ix_notifications_webhook_id"), "notifications", ["webhook_id"])
    op.create_index(
        op.f("ix_notifications_status_next_attempt_at"),
        "notifications",
        ["status", "next_attempt_at"],
    )


def downgrade() -> None:
    op.drop_table("notifications")
    op.drop_table("webhooks")
    op.drop_table("alert_configs")
    op.drop_table("alert_state")
    op.drop_index("uq_alerts_open", table_name="alerts")
    op.drop_table("alerts")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("health")
