"""Storage schema (SQLAlchemy 2 typed models); `alembic/versions/` must match it exactly.

Per-layer statistics dominate volume (layers x steps), so `layer_stats` keeps one row per
(run, rank, statistic, step) holding a packed little-endian float64 array ordered by the
run's layer index (`layers.idx`): one insert per sampled step instead of one per value,
and a layers x steps heatmap is one range scan. A layer absent from a record is stored as
`MISSING`, a NaN with its own payload, so a genuinely NaN statistic stays distinguishable.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Literal, get_args

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from ampwatch.agent.wire import MAX_NAME_LENGTH, NAN, NON_FINITE, WireFloat

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


class _RawDouble(Double[float]):
    """Double without SQLAlchemy's float() bind coercion, which would turn 'NaN' back into
    a NaN that SQLite then stores as NULL."""

    def bind_processor(self, dialect: Dialect) -> None:
        return None


class NonFiniteFloat(TypeDecorator[float]):
    """A double column in which NaN, +Inf and -Inf survive, distinct from NULL.

    PostgreSQL's float8 stores all three natively. SQLite keeps +-Inf as REAL but binds a
    NaN as NULL, which would turn "the loss was NaN" into "not measured" -- the very signal
    ampwatch exists for. On SQLite a NaN is therefore written as the text 'NaN' (a REAL
    column keeps text it cannot convert) and read back as float NaN. In SQL on SQLite such
    a value compares greater than every number; compare in Python, not in WHERE clauses.
    """

    impl = _RawDouble
    cache_ok = True

    def process_bind_param(self, value: float | None, dialect: Dialect) -> Any:
        return sqlite_float(value) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> float | None:
        if isinstance(value, str):
            return float(NON_FINITE[value])
        return None if value is None else float(value)


def sqlite_float(value: WireFloat | None) -> float | str | None:
    """A float, or a wire float, as a `NonFiniteFloat` column holds it on SQLite: a NaN as
    the text 'NaN', +-Inf as REAL. Ingest binds step rows with it directly (~70 ns a value;
    decode_float, then a NaN check, cost ~4x that per value of the hottest insert).

    >>> sqlite_float(float("nan")), sqlite_float("NaN"), sqlite_float("-Infinity")
    ('NaN', 'NaN', -inf)
    """
    if type(value) is str:
        return NAN if value == NAN else NON_FINITE[value]
    if isinstance(value, float) and math.isnan(value):
        return NAN
    return value


class SafeString(TypeDecorator[str]):
    """Text from outside (names, a run's end reason, alert messages quoting a finding, a
    delivery error) stored alike on both backends: a NUL character, which PostgreSQL's
    text refuses (a NUL in a run_end reason answered 500 there, and the agent retried the
    batch forever) while SQLite kept it, is stored as U+FFFD on both. Identifiers never
    get here with one (the wire's `Name` refuses it with a 422); free text is kept, marked.

    >>> SafeString().process_bind_param("disk\\x00full", None)
    'disk\\ufffdfull'
    """

    impl = String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect | None) -> str | None:
        return value.replace("\x00", "\ufffd") if value and "\x00" in value else value


class SafeText(SafeString):
    """`SafeString` without a length."""

    impl = Text
    cache_ok = True


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python, on every backend.

    SQLite has no time zones and hands back naive values; normalising at the column
    boundary keeps comparisons between stored and fresh timestamps from raising.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: ampwatch stores aware UTC times")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value


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


class IngestedBatch(Base):
    """(run, stream, seq) of every stored batch: a retried batch is recognised and not
    re-applied. `stream` is the sending process's id: the ranks of one run, and a run
    resumed under its old id, each number seq from 0. Rows stored before revision 0004
    have the empty stream."""

    __tablename__ = "ingested_batches"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    stream: Mapped[str] = mapped_column(String(64), primary_key=True, server_default="")
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Step(Base):
    """One optimizer step on one rank; NULL means not measured, NaN/Inf are kept as such."""

    __tablename__ = "steps"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    loss: Mapped[float | None] = mapped_column(NonFiniteFloat)
    loss_scale: Mapped[float | None] = mapped_column(NonFiniteFloat)
    skipped: Mapped[bool] = mapped_column(Boolean)
    grad_norm: Mapped[float | None] = mapped_column(NonFiniteFloat)
    lr: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_norm_mean: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_norm_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    #: The grad norm after the loop's clip_grad_norm_ (`grad_norm` is before it).
    grad_norm_clipped: Mapped[float | None] = mapped_column(NonFiniteFloat)
    #: The activation norm of the final norm's input (the last block's output).
    act_prenorm_mean: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_prenorm_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    #: Maxima over layers of Adam's second-moment lag and update/weight ratio.
    adam_rms_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    update_ratio_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    #: `activation_norm_spike`'s firing threshold for the value it judged at this step, as
    #: the rule engine computed it at ingest with the run's effective settings
    #: (`ampwatch.server.alerts.activation.firing_threshold`); NULL where it judged nothing
    #: (rule off, warm-up calibration, baseline too short, a non-finite norm).
    act_threshold: Mapped[float | None] = mapped_column(NonFiniteFloat)
    #: The rule judged this step's value above its threshold (NULL: not judged).
    act_above: Mapped[bool | None] = mapped_column(Boolean)
    #: Every param group's lr when there is more than one: packed little-endian float64
    #: (`ampwatch.server.packed`), NaN and Inf kept; NULL with a single group.
    lr_groups: Mapped[bytes | None] = mapped_column(LargeBinary)


class GradNormPart(Base):
    """One rank's part of a sharded step's global grad norm (wire `grad_sumsq`): the
    collector adds the parts of a step into `steps.grad_norm` of its lowest rank once all
    `parts` arrived (`ampwatch.server.ingest`); kept, so that a re-sent part recombines
    the same norm whatever the order of arrival."""

    __tablename__ = "grad_norm_parts"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    sumsq: Mapped[float] = mapped_column(NonFiniteFloat)
    parts: Mapped[int] = mapped_column(Integer)


class AbandonedStep(Base):
    """A step a resumed run abandoned: recorded after the resume plan's checkpoint
    (`from_step` of the `resumed` event) before the run was resumed from it. Moved here out
    of `steps` when the `resumed` event is stored (`ampwatch.server.rollback`), so `steps`
    and its rollups hold the live branch only while the abandoned tail stays drawable (the
    run page greys it). `branch` numbers the run's resumes from 1. Only the fields the
    rollback is drawn with are kept."""

    __tablename__ = "abandoned_steps"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    branch: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    from_step: Mapped[int] = mapped_column(BigInteger)
    skipped: Mapped[bool] = mapped_column(Boolean)
    loss: Mapped[float | None] = mapped_column(NonFiniteFloat)
    loss_scale: Mapped[float | None] = mapped_column(NonFiniteFloat)
    grad_norm: Mapped[float | None] = mapped_column(NonFiniteFloat)


class _StepExtremes:
    """The columns a step rollup of any level holds after its key: the bucket's first and
    last step, its skip and step counts, and min and max of every step field."""

    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    skipped_count: Mapped[int] = mapped_column(Integer)
    #: Step rows in the bucket: exact where the agent dropped steps inside it, which the
    #: span `last_step - first_step + 1` would count.
    step_count: Mapped[int] = mapped_column(Integer, server_default="0")
    loss_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    loss_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    loss_scale_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    loss_scale_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    grad_norm_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    grad_norm_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    lr_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    lr_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_norm_mean_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_norm_mean_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_norm_max_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_norm_max_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    grad_norm_clipped_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    grad_norm_clipped_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_prenorm_mean_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_prenorm_mean_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_prenorm_max_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_prenorm_max_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    adam_rms_max_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    adam_rms_max_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    update_ratio_max_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    update_ratio_max_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    #: `Step.act_threshold`'s extremes and the steps judged above it: the series draws the
    #: bucket's minimum threshold where a step was above, else its maximum.
    act_threshold_min: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_threshold_max: Mapped[float | None] = mapped_column(NonFiniteFloat)
    act_above_count: Mapped[int] = mapped_column(Integer, server_default="0")


class StepRollup(_StepExtremes, Base):
    """Min and max of every step field over the `ROLLUP_WIDTH` steps from `bucket_start`.

    A downsampled 100k-step series from raw rows is a 100k-row scan (about 45 ms in SQLite
    on this machine before any HTTP); from these rows it is a 1,600-row scan. Ingest
    recomputes each touched rollup from the raw rows in the same transaction, so a re-sent
    step can never leave a stale extreme behind. NaN sorts above every number in both
    SQLite (as the text 'NaN') and PostgreSQL, so `*_max` is NaN whenever a NaN was seen.
    """

    __tablename__ = "step_rollups"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)


class StepRollupLevel(_StepExtremes, Base):
    """`StepRollup`'s columns over the `level` steps from `bucket_start`, for the levels
    above it (256, 1,024, ... 65,536: `ampwatch.server.rollups`), each computed from the
    level below, and one under it (16, from the raw steps); a whole-run series of a
    2M-step run reads ~2,000 rows, not 31,000, and a zoomed window of 50,000 steps reads
    ~3,000, not 50,000.

    A table of its own, not a level column in `step_rollups`: every reader of the 64-step
    rollups (run totals, the advisor, the runs list) stays as it is.
    """

    __tablename__ = "step_rollup_levels"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)


class RunStepTotals(Base):
    """Per (run, rank): the steps and skipped steps stored, and the last step, kept by
    `refresh_step_rollups` in the ingest transaction (the rollups' change, added).

    The runs list and every scrape of `/metrics` read these: summing a run's rollups is
    a scan of its whole length (1,000 runs of 10,000 steps: 157k rows, ~26 ms in SQLite
    on this machine, and ten times that for 100k-step runs); this is a row per rank.
    """

    __tablename__ = "run_step_totals"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    steps: Mapped[int] = mapped_column(BigInteger)
    skipped_steps: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)


class Layer(Base):
    """A parameter tensor of a run, numbered in order of first sight (`idx`)."""

    __tablename__ = "layers"
    __table_args__ = (UniqueConstraint("run_id", "name"),)

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(SafeString(MAX_NAME_LENGTH))


class Module(Base):
    """A leaf module of a run whose activations are measured, numbered in order of first
    sight (`idx`). Apart from `layers`: module paths are not parameter names, and sharing
    one index would give every parameter statistic's matrix a null column per module."""

    __tablename__ = "modules"
    __table_args__ = (UniqueConstraint("run_id", "name"),)

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(SafeString(MAX_NAME_LENGTH))


class LayerStat(Base):
    """One statistic for every layer of a run at one step: packed float64, by layer idx.
    Activation statistics (wire `ACTIVATION_STATS`) are packed by module idx instead."""

    __tablename__ = "layer_stats"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    stat: Mapped[str] = mapped_column(String(64), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    values: Mapped[bytes] = mapped_column(LargeBinary)


class LayerRollup(Base):
    """Per-layer maxima and minima of one statistic over the `level` steps from
    `bucket_start` (`ampwatch.server.layer_rollups`): packed like `layer_stats.values`.

    Levels of 64, 256, ... 65,536 steps, so that a whole-run heatmap or layer series reads
    a bounded number of rows at any run length (at 2M steps: ~2,000 rows, not 200,000).
    """

    __tablename__ = "layer_rollups"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    stat: Mapped[str] = mapped_column(String(64), primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    #: Raw samples the bucket holds.
    samples: Mapped[int] = mapped_column(Integer)
    maxima: Mapped[bytes] = mapped_column(LargeBinary)
    minima: Mapped[bytes] = mapped_column(LargeBinary)


class LayerHistogram(Base):
    """One layer's gradient exponent histogram at one step: bins `first_bin`.. onwards.

    `counts` is packed little-endian int64, the non-empty span the agent sent. A row per
    (layer, step) because every read is one layer's histograms at a step or over steps.
    """

    __tablename__ = "layer_histograms"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    layer_idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    first_bin: Mapped[int] = mapped_column(SmallInteger)
    counts: Mapped[bytes] = mapped_column(LargeBinary)


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


class AlertState(Base):
    """A rule evaluator's rolling state for a run (baselines, windows, counters), so that
    each batch is evaluated from this row and the batch alone -- cost independent of the
    run's length -- and so that every collector worker continues from the same state.
    `key` is the evaluator's own (a rule name, or one row for a group of rules)."""

    __tablename__ = "alert_state"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
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
