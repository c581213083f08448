"""Storage schema (SQLAlchemy 2 typed models); `alembic/versions/` must match it exactly.

This module holds the declarative `Base`, the statuses, and the tables of a row per thing:
projects and tokens, runs and the batches and events they received, alerts, their rule
state and overrides, webhooks and notifications. The per-step tables are in
`ampwatch.server.step_models`, the per-layer ones in `ampwatch.server.layer_models`,
their column types in `ampwatch.server.column_types`. `Base.metadata` holds every table
once `step_models` and `layer_models` are imported too (the collector imports them; so
does Alembic's `env.py`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal, get_args

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ampwatch.agent.wire import MAX_NAME_LENGTH
from ampwatch.server.column_types import SafeString, SafeText, UTCDateTime

#: Constraint names are deterministic, so migrations can drop and alter them by name.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

RunStatus = Literal["running", "ended"]
RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)
AlertStatus = Literal["pending", "firing", "resolved"]
ALERT_STATUSES: tuple[str, ...] = get_args(AlertStatus)
Severity = Literal["info", "warning", "critical"]
SEVERITIES: tuple[str, ...] = get_args(Severity)
Health = Literal["ok", "warning", "critical"]
HEALTHS: tuple[str, ...] = get_args(Health)
#: What a token may do (`ampwatch.server.auth.GRANTS`): write (and read), read, or only
#: scrape `/metrics`.
TokenScope = Literal["write", "read", "metrics"]
TOKEN_SCOPES: tuple[str, ...] = get_args(TokenScope)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class RunRow:
    """A table of a run's rows: keyed by the run first (`sort_order`: before the key
    columns of the table's own class), deleted with it."""

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True, sort_order=-1
    )


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Project(Base):
    """A tenant: its tokens read and write only its runs.

    Runs refer to it by name (`runs.project`, a foreign key to the unique `name`): the API
    speaks project names, names never change, and no run query needs a join.
    """

    __tablename__ = "projects"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(SafeString(MAX_NAME_LENGTH), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    #: Bumped by every write of an alert of the project's runs
    #: (`ampwatch.server.run_version.note_project_alerts`): the ETag of its alert lists.
    alerts_version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class Token(Base):
    """An API token, stored as the SHA-256 of its secret (`ampwatch.server.auth`).

    `prefix` is the public part of the token, shown by `ampwatch token list` and used to
    find the row; `project_id` NULL means an admin token (every project); `scope` what it
    may do there (tokens made before revision 0008 are `write`, as they could write).
    """

    __tablename__ = "tokens"
    __table_args__ = (
        CheckConstraint(
            "scope IN ({})".format(", ".join(f"'{s}'" for s in TOKEN_SCOPES)), name="scope"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project_id: Mapped[int | None] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), index=True
    )
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(SafeString(MAX_NAME_LENGTH))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    scope: Mapped[TokenScope] = mapped_column(String(16), default="write", server_default="write")


#: What identifies a run for its writers: client run ids are chosen by agents (often from
#: a job name), so they are unique per project only (revision 0007).
RUN_KEY = ("project", "client_run_id")


class Run(Base):
    """One training run, keyed by its project and the id its agent made up (`RUN_KEY`)."""

    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint(*RUN_KEY),
        CheckConstraint(
            "status IN ({})".format(", ".join(f"'{s}'" for s in RUN_STATUSES)), name="status"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    client_run_id: Mapped[str] = mapped_column(SafeString(MAX_NAME_LENGTH))
    name: Mapped[str] = mapped_column(SafeString(MAX_NAME_LENGTH))
    project: Mapped[str] = mapped_column(
        SafeString(MAX_NAME_LENGTH), ForeignKey("projects.name"), index=True
    )
    status: Mapped[RunStatus] = mapped_column(String(16), default="running")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    end_reason: Mapped[str | None] = mapped_column(SafeString(MAX_NAME_LENGTH))
    # Records the agent dropped rather than block training (wire `dropped`), summed over
    # the run's batches: the dashboard must say when what it shows is incomplete.
    dropped_steps: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    dropped_layer_stats: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    dropped_events: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    #: The worst severity among the run's firing alerts ('ok' when none fires), kept by
    #: the alert engine in the transaction that moves an alert: the runs list filters and
    #: sorts on it without touching `alerts`.
    health: Mapped[Health] = mapped_column(String(16), default="ok", server_default="ok")
    #: Raw layer samples before this step were aged into the rollups
    #: (`ampwatch.server.layer_rollups.age_layer_stats`); NULL when none were.
    layer_stats_aged_before: Mapped[int | None] = mapped_column(BigInteger)
    #: When the collector stored the run's latest `resumed` event (`watch(resume_from=)`):
    #: alerts started before it belong to abandoned branches (the advisor's incident is
    #: the live branch's); NULL if never resumed.
    resumed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    #: Bumped by every write that changes what the run's reads answer
    #: (`ampwatch.server.run_version`): the ETag of those answers.
    version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    #: Bumped by every write of the run's alerts (`run_version.bump_alerts`): the ETag of
    #: its alerts page.
    alerts_version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class IngestedBatch(RunRow, Base):
    """(run, stream, seq) of every stored batch: a retried batch is recognised and not
    re-applied. `stream` is the sending process's id: the ranks of one run, and a run
    resumed under its old id, each number seq from 0. Rows stored before revision 0004
    have the empty stream."""

    __tablename__ = "ingested_batches"

    stream: Mapped[str] = mapped_column(String(64), primary_key=True, server_default="")
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Event(Base):
    """Something that happened once: run start, checkpoint saved, run end, a finding."""

    __tablename__ = "events"
    __table_args__ = (Index(None, "run_id", "time"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    step: Mapped[int | None] = mapped_column(BigInteger)
    time: Mapped[datetime] = mapped_column(UTCDateTime)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)


#: An alert that is not resolved: at most one per (run, rule, layer) at any time.
OPEN_ALERT = "status IN ('pending', 'firing')"


def _in(column: str, values: tuple[str, ...]) -> str:
    return "{} IN ({})".format(column, ", ".join(f"'{v}'" for v in values))


class Alert(Base):
    """One firing of one rule for one run (and layer, for per-layer rules; '' otherwise).

    pending (condition seen, its `for` duration not yet met) -> firing -> resolved. The
    partial unique index keeps at most one open alert per (run, rule, layer): the dedupe
    holds across collector workers, not just within one process. Steps say *when in
    training*; times say when the collector saw it.
    """

    __tablename__ = "alerts"
    __table_args__ = (
        CheckConstraint(_in("status", ALERT_STATUSES), name="status"),
        CheckConstraint(_in("severity", SEVERITIES), name="severity"),
        Index(
            "uq_alerts_open",
            "run_id",
            "rule",
            "layer",
            unique=True,
            sqlite_where=text(OPEN_ALERT),
            postgresql_where=text(OPEN_ALERT),
        ),
        Index(None, "run_id", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rule: Mapped[str] = mapped_column(String(64))
    layer: Mapped[str] = mapped_column(SafeString(MAX_NAME_LENGTH), default="")
    severity: Mapped[Severity] = mapped_column(String(16))
    status: Mapped[AlertStatus] = mapped_column(String(16))
    #: The step at which the condition first held (the alert's onset), when its `for`
    #: duration was met, and when the resolve condition held.
    started_step: Mapped[int] = mapped_column(BigInteger)
    fired_step: Mapped[int | None] = mapped_column(BigInteger)
    resolved_step: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    fired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    resolved_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    #: Why it fired, in words with the values and steps; `values` has them as numbers.
    message: Mapped[str] = mapped_column(SafeText, default="")
    values: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class AlertState(RunRow, Base):
    """A rule evaluator's rolling state for a run (baselines, windows, counters), so that
    each batch is evaluated from this row and the batch alone -- cost independent of the
    run's length -- and so that every collector worker continues from the same state.
    `key` is the evaluator's own (a rule name, or one row for a group of rules)."""

    __tablename__ = "alert_state"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class AlertConfig(Base):
    """Rule threshold overrides for a project or for one run (exactly one of the two).

    `rules` maps a rule name to its overridden settings; a run's overrides win over its
    project's, which win over the collector's file and the built-in defaults."""

    __tablename__ = "alert_configs"
    __table_args__ = (CheckConstraint("(project IS NULL) <> (run_id IS NULL)", name="one_scope"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project: Mapped[str | None] = mapped_column(
        SafeString(MAX_NAME_LENGTH),
        ForeignKey("projects.name", ondelete="CASCADE"),
        unique=True,
    )
    run_id: Mapped[int | None] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), unique=True
    )
    rules: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


WebhookFormat = Literal["slack", "generic"]
WEBHOOK_FORMATS: tuple[str, ...] = get_args(WebhookFormat)


class Webhook(Base):
    """Where alert transitions are posted; `project` NULL means every project (admin)."""

    __tablename__ = "webhooks"
    __table_args__ = (
        CheckConstraint(_in("format", WEBHOOK_FORMATS), name="format"),
        CheckConstraint(_in("min_severity", SEVERITIES), name="min_severity"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project: Mapped[str | None] = mapped_column(
        SafeString(MAX_NAME_LENGTH), ForeignKey("projects.name", ondelete="CASCADE"), index=True
    )
    url: Mapped[str] = mapped_column(SafeString(2048))
    format: Mapped[WebhookFormat] = mapped_column(String(16))
    min_severity: Mapped[Severity] = mapped_column(String(16), default="warning")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


NotificationStatus = Literal["pending", "delivered", "failed"]
NOTIFICATION_STATUSES: tuple[str, ...] = get_args(NotificationStatus)


class Notification(Base):
    """Outbox and delivery log in one: written in the ingest transaction that moved the
    alert (so a transition is never lost and never slows ingest), delivered later by a
    background worker that retries with backoff and records each outcome here."""

    __tablename__ = "notifications"
    __table_args__ = (
        CheckConstraint(_in("status", NOTIFICATION_STATUSES), name="status"),
        CheckConstraint("transition IN ('firing', 'resolved')", name="transition"),
        Index(None, "status", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    alert_id: Mapped[int] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"), index=True)
    webhook_id: Mapped[int] = mapped_column(
        ForeignKey("webhooks.id", ondelete="CASCADE"), index=True
    )
    transition: Mapped[str] = mapped_column(String(16))
    status: Mapped[NotificationStatus] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_error: Mapped[str | None] = mapped_column(SafeText)
    response_status: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
