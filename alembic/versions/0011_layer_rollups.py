"""`layer_rollups`: per-layer maxima and minima of each layer statistic over 64..65,536-step
buckets, and `runs.layer_stats_aged_before`, the horizon of aged raw layer samples.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01

A whole-run heatmap or layer series read every raw row of the run (7 s extrapolated for a
2M-step x 1,000-tensor run); from these rows it reads ~2,000 at any length
(`ampwatch.server.layer_rollups`). Existing runs are backfilled here, one (run, rank,
statistic) at a time, with the reduction ingest ran at this revision, so that stored and
freshly ingested rollups cannot differ: every level's bucket is a direct aggregation of its
raw rows (a maximum is NaN when any sample was NaN, a minimum NaN only when nothing but
NaN was measured, MISSING where nothing was), which is what ingest's composition of levels
equals (tests/server/test_server_layer_rollups.py).

A frozen snapshot: the levels, the packed format and the reduction are spelled out as they
were at this revision, importing nothing from the package (tests/server/test_server_migrations.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Bucket widths of the levels, finest first (`layer_rollups.LAYER_LEVELS` then).
_LEVELS = (64, 256, 1_024, 4_096, 16_384, 65_536)
#: A layer the packed row does not measure (`packed.MISSING_BITS`): a quiet NaN's bits.
_MISSING_BITS = 0x7FF8_0000_0000_0A3F
_COLUMNS = (
    "run_id", "rank", "stat", "level", "bucket_start",
    "first_step", "last_step", "samples", "maxima", "minima",
)  # fmt: skip


def upgrade() -> None:
    op.create_table(
        "layer_rollups",
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("stat", sa.String(length=64), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("maxima", sa.LargeBinary(), nullable=False),
        sa.Column("minima", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint(
            "run_id", "rank", "stat", "level", "bucket_start", name=op.f("pk_layer_rollups")
        ),
    )
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("layer_stats_aged_before", sa.BigInteger(), nullable=True))
    _backfill()


def _backfill() -> None:
    connection = op.get_bind()
    table = sa.table("layer_rollups", *(sa.column(c) for c in _COLUMNS))
    keys = connection.execute(
        sa.text("SELECT DISTINCT run_id, rank, stat FROM layer_stats ORDER BY run_id, rank, stat")
    ).all()
    for run_id, rank, stat in keys:
        rows = connection.execute(
            sa.text(
                'SELECT step, "values" FROM layer_stats WHERE run_id = :run AND rank = :rank'
                " AND stat = :stat ORDER BY step"
            ),
            {"run": run_id, "rank": rank, "stat": stat},
        ).all()
        rollups = _rollups(run_id, rank, stat, [r[0] for r in rows], [bytes(r[1]) for r in rows])
        if rollups:
            connection.execute(table.insert(), [dict(zip(_COLUMNS, r)) for r in rollups])


def _rollups(
    run_id: int, rank: int, stat: str, steps: list[int], blobs: list[bytes]
) -> list[tuple[object, ...]]:
    """Every level's rows of one (run, rank, statistic) from its raw rows, in step order."""
    import numpy as np

    if not steps:
        return []
    width = max(len(b) // 8 for b in blobs)
    bits = np.full((len(blobs), width), _MISSING_BITS, dtype="<u8")
    for i, blob in enumerate(blobs):  # rows written before later layers appeared are shorter
        stored = np.frombuffer(blob, dtype="<u8")[:width]
        bits[i, : stored.size] = stored
    missing = bits == _MISSING_BITS
    values = bits.view(np.float64)
    nan = np.isnan(values) & ~missing
    ordinary = ~(missing | nan)
    at = np.array(steps, dtype=np.int64)

    def packed(extremes: object, none: object) -> bytes:
        out = np.asarray(extremes).astype("<f8").view("<u8").copy()
        out[np.asarray(none)] = _MISSING_BITS
        return bytes(out.tobytes())

    rows: list[tuple[object, ...]] = []
    for level in _LEVELS:
        buckets = at // level
        starts = np.flatnonzero(np.concatenate(([True], np.diff(buckets) != 0))).astype(np.intp)
        max_none = np.logical_and.reduceat(missing, starts, axis=0)
        maxima = np.maximum.reduceat(np.where(missing, -np.inf, values), starts, axis=0)
        maxima[max_none] = np.nan
        has_ordinary = np.logical_or.reduceat(ordinary, starts, axis=0)
        minima = np.minimum.reduceat(np.where(ordinary, values, np.inf), starts, axis=0)
        minima = np.where(has_ordinary, minima, np.nan)
        min_none = ~(has_ordinary | np.logical_or.reduceat(nan, starts, axis=0))
        firsts = np.minimum.reduceat(at, starts)
        lasts = np.maximum.reduceat(at, starts)
        counts = np.add.reduceat(np.ones_like(at), starts)
        rows += [
            (
                run_id,
                rank,
                stat,
                level,
                int(buckets[start]) * level,
                int(firsts[i]),
                int(lasts[i]),
                int(counts[i]),
                packed(maxima[i], max_none[i]),
                packed(minima[i], min_none[i]),
            )
            for i, start in enumerate(starts)
        ]
    return rows


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("layer_stats_aged_before")
    op.drop_table("layer_rollups")
