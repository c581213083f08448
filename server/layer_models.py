"""The per-layer tables: the run's layers and modules, their statistics, rollups and
gradient histograms.

Per-layer statistics dominate volume (layers x steps), so `layer_stats` keeps one row per
(run, rank, statistic, step) holding a packed little-endian float64 array ordered by the
run's layer index (`layers.idx`): one insert per sampled step instead of one per value,
and a layers x steps heatmap is one range scan. A layer absent from a record is stored as
`MISSING`, a NaN with its own payload, so a genuinely NaN statistic stays distinguishable.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Integer, LargeBinary, SmallInteger, String, UniqueConstraint
from sqlalchemy.orm import Mapped, declared_attr, mapped_column

from ampwatch.agent.wire import MAX_NAME_LENGTH
from ampwatch.server.column_types import SafeString
from ampwatch.server.models import Base, RunRow


class _NumberedName(RunRow):
    """A run's name numbered in order of first sight (`idx`): the index the packed arrays
    are ordered by."""

    @declared_attr.directive
    def __table_args__(cls) -> tuple[UniqueConstraint]:
        return (UniqueConstraint("run_id", "name"),)

    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(SafeString(MAX_NAME_LENGTH))


class Layer(_NumberedName, Base):
    """A parameter tensor of a run, numbered in order of first sight (`idx`)."""

    __tablename__ = "layers"


class Module(_NumberedName, Base):
    """A leaf module of a run whose activations are measured, numbered in order of first
    sight (`idx`). Apart from `layers`: module paths are not parameter names, and sharing
    one index would give every parameter statistic's matrix a null column per module."""

    __tablename__ = "modules"


class LayerStat(RunRow, Base):
    """One statistic for every layer of a run at one step: packed float64, by layer idx.
    Activation statistics (wire `ACTIVATION_STATS`) are packed by module idx instead."""

    __tablename__ = "layer_stats"

    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    stat: Mapped[str] = mapped_column(String(64), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    values: Mapped[bytes] = mapped_column(LargeBinary)


class LayerRollup(RunRow, Base):
    """Per-layer maxima and minima of one statistic over the `level` steps from
    `bucket_start` (`ampwatch.server.layer_rollups`): packed like `layer_stats.values`.

    Levels of 64, 256, ... 65,536 steps, so that a whole-run heatmap or layer series reads
    a bounded number of rows at any run length (at 2M steps: ~2,000 rows, not 200,000).
    """

    __tablename__ = "layer_rollups"

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


class LayerHistogram(RunRow, Base):
    """One layer's gradient exponent histogram at one step: bins `first_bin`.. onwards.

    `counts` is packed little-endian int64, the non-empty span the agent sent. A row per
    (layer, step) because every read is one layer's histograms at a step or over steps.
    """

    __tablename__ = "layer_histograms"

    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    layer_idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    first_bin: Mapped[int] = mapped_column(SmallInteger)
    counts: Mapped[bytes] = mapped_column(LargeBinary)
