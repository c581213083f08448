"""The per-step tables: a step's row per rank, the parts of a sharded step's grad norm,
the steps a resumed run abandoned, the step rollups and each rank's totals. Their columns
follow `ampwatch.agent.wire.STEP_FLOAT_FIELDS` (`tests/test_step_fields.py`).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Integer, LargeBinary
from sqlalchemy.orm import Mapped, mapped_column

from ampwatch.server.column_types import NonFiniteFloat
from ampwatch.server.models import Base, RunRow


class Step(RunRow, Base):
    """One optimizer step on one rank; NULL means not measured, NaN/Inf are kept as such."""

    __tablename__ = "steps"

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


class GradNormPart(RunRow, Base):
    """One rank's part of a sharded step's global grad norm (wire `grad_sumsq`): the
    collector adds the parts of a step into `steps.grad_norm` of its lowest rank once all
    `parts` arrived (`ampwatch.server.grad_norm_parts`); kept, so that a re-sent part recombines
    the same norm whatever the order of arrival."""

    __tablename__ = "grad_norm_parts"

    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    sumsq: Mapped[float] = mapped_column(NonFiniteFloat)
    parts: Mapped[int] = mapped_column(Integer)


class AbandonedStep(RunRow, Base):
    """A step a resumed run abandoned: recorded after the resume plan's checkpoint
    (`from_step` of the `resumed` event) before the run was resumed from it. Moved here out
    of `steps` when the `resumed` event is stored (`ampwatch.server.rollback`), so `steps`
    and its rollups hold the live branch only while the abandoned tail stays drawable (the
    run page greys it). `branch` numbers the run's resumes from 1. Only the fields the
    rollback is drawn with are kept."""

    __tablename__ = "abandoned_steps"

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


class StepRollup(RunRow, _StepExtremes, Base):
    """Min and max of every step field over the `ROLLUP_WIDTH` steps from `bucket_start`.

    A downsampled 100k-step series from raw rows is a 100k-row scan (about 45 ms in SQLite
    on this machine before any HTTP); from these rows it is a 1,600-row scan. Ingest
    recomputes each touched rollup from the raw rows in the same transaction, so a re-sent
    step can never leave a stale extreme behind. NaN sorts above every number in both
    SQLite (as the text 'NaN') and PostgreSQL, so `*_max` is NaN whenever a NaN was seen.
    """

    __tablename__ = "step_rollups"

    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)


class StepRollupLevel(RunRow, _StepExtremes, Base):
    """`StepRollup`'s columns over the `level` steps from `bucket_start`, for the levels
    above it (256, 1,024, ... 65,536: `ampwatch.server.rollups`), each computed from the
    level below, and one under it (16, from the raw steps); a whole-run series of a
    2M-step run reads ~2,000 rows, not 31,000, and a zoomed window of 50,000 steps reads
    ~3,000, not 50,000.

    A table of its own, not a level column in `step_rollups`: every reader of the 64-step
    rollups (run totals, the advisor, the runs list) stays as it is.
    """

    __tablename__ = "step_rollup_levels"

    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)


class RunStepTotals(RunRow, Base):
    """Per (run, rank): the steps and skipped steps stored, and the last step, kept by
    `refresh_step_rollups` in the ingest transaction (the rollups' change, added).

    The runs list and every scrape of `/metrics` read these: summing a run's rollups is
    a scan of its whole length (1,000 runs of 10,000 steps: 157k rows, ~26 ms in SQLite
    on this machine, and ten times that for 100k-step runs); this is a row per rank.
    """

    __tablename__ = "run_step_totals"

    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    steps: Mapped[int] = mapped_column(BigInteger)
    skipped_steps: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
