"""Step rollups at every level (`step_rollups` and `step_rollup_levels`) against a direct
aggregation of the raw steps, on SQLite and PostgreSQL; the downsampled step series read
from them against a direct min/max per bucket; the migration's backfill.

The reference is plain Python over the raw rows read back from `steps`.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from rollup_property import ROLLUP_PROPERTY
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.agent.wire import STEP_FLOAT_FIELDS, WIRE_VERSION, encode_float
from ampwatch.server import migrate, series
from ampwatch.server.ingest import ingest_batch
from ampwatch.server.layer_rollups import LAYER_LEVELS
from ampwatch.server.rollups import FINE_LEVEL, ROLLUP_WIDTH, STEP_LEVELS
from ampwatch.server.schemas.wire import BatchIn
from ampwatch.server.step_models import Step, StepRollup, StepRollupLevel

_run_ids = itertools.count()
#: The fields a test step carries (the others stay unmeasured, NULL).
FIELDS = ("loss", "loss_scale", "grad_norm", "lr")

values = st.one_of(
    st.none(),
    st.floats(allow_nan=False, allow_infinity=True, width=64),
    st.just(math.nan),
    st.floats(0, 1),
)


def send(sessions: sessionmaker[Session], run: str, seq: int, steps: list[dict[str, Any]]) -> int:
    """Ingest one batch of step records (step, rank, skipped and `FIELDS`)."""
    batch = {
        "wire_version": WIRE_VERSION,
        "run": {"client_run_id": run, "name": run, "project": "default"},
        "stream": "0",
        "seq": seq,
        "steps": [{k: encode_float(v) if k in FIELDS else v for k, v in s.items()} for s in steps],
    }
    with sessions() as session:
        ack = ingest_batch(session, BatchIn.model_validate(batch), evaluate_alerts=False)
        return int(ack.run_id)


@st.composite
def batches(draw: st.DrawFn) -> list[list[dict[str, Any]]]:
    """Batches of steps up to 300,000 (every level, several top buckets), re-sent steps
    with new values across batches, skips, NaN, infinities and unmeasured fields."""
    steps = draw(st.lists(st.integers(0, 300_000), min_size=1, max_size=40))
    out = [
        {"step": step, "rank": draw(st.integers(0, 1)), "skipped": draw(st.booleans()),
         **{field: draw(values) for field in FIELDS}}
        for step in steps
    ]  # fmt: skip
    cuts = sorted(draw(st.lists(st.integers(0, len(out)), max_size=3)))
    parts = [out[a:b] for a, b in zip([0, *cuts], [*cuts, len(out)])]
    return [list({(r["step"], r["rank"]): r for r in part}.values()) for part in parts]


def _nan_max(seen: list[float]) -> float | None:
    return None if not seen else math.nan if any(map(math.isnan, seen)) else max(seen)


def _nan_min(seen: list[float]) -> float | None:
    numbers = [v for v in seen if not math.isnan(v)]
    return min(numbers) if numbers else math.nan if seen else None


def _key(value: float | None) -> Any:
    """A value comparable with ==, NaN included."""
    return "nan" if value is not None and math.isnan(value) else value


def _aggregate(rows: list[Any]) -> tuple[Any, ...]:
    """(first, last, skipped, steps, min and max of every field) of raw `Step` rows."""
    extremes = []
    for field in STEP_FLOAT_FIELDS:
        seen = [v for v in (getattr(r, field) for r in rows) if v is not None]
        extremes += [_key(_nan_min(seen)), _key(_nan_max(seen))]
    steps = [r.step for r in rows]
    return (min(steps), max(steps), sum(r.skipped for r in rows), len(rows), *extremes)


def _stored(row: StepRollup | StepRollupLevel) -> tuple[Any, ...]:
    extremes = [
        _key(getattr(row, f"{field}_{extreme}"))
        for field in STEP_FLOAT_FIELDS
        for extreme in ("min", "max")
    ]
    return (row.first_step, row.last_step, row.skipped_count, row.step_count, *extremes)


def _levels(session: Session, run_id: int) -> dict[tuple[int, int, int], tuple[Any, ...]]:
    """(rank, level, bucket_start) -> stored rollup, every level."""
    out = {
        (r.rank, ROLLUP_WIDTH, r.bucket_start): _stored(r)
        for r in session.scalars(select(StepRollup).where(StepRollup.run_id == run_id))
    }
    for r in session.scalars(select(StepRollupLevel).where(StepRollupLevel.run_id == run_id)):
        out[(r.rank, r.level, r.bucket_start)] = _stored(r)
    return out


@ROLLUP_PROPERTY
@given(sent=batches())
def test_every_level_equals_a_direct_aggregation_of_the_raw_steps(
    sessions: sessionmaker[Session], sent: list[list[dict[str, Any]]]
) -> None:
    run = f"prop-{next(_run_ids)}"
    run_id = 0
    for seq, batch in enumerate(sent):
        if batch:
            run_id = send(sessions, run, seq, batch)
    if not run_id:
        return
    with sessions() as session:
        raw = list(session.scalars(select(Step).where(Step.run_id == run_id)))
        got = _levels(session, run_id)
    groups: dict[tuple[int, int, int], list[Any]] = {}
    for row in raw:
        for level in STEP_LEVELS:
            groups.setdefault((row.rank, level, row.step // level * level), []).append(row)
    assert got == {key: _aggregate(rows) for key, rows in groups.items()}


LONG = 150_000


def _long_run(sessions: sessionmaker[Session]) -> int:
    """One rank, `LONG` steps: a skip every 1,009 steps, a NaN, an overflow, a spike, a dip,
    a gap, and an lr measured on part of the run only."""
    run_id = 0
    chunk: list[dict[str, Any]] = []
    for step in range(1, LONG + 1):
        if 40_000 <= step < 40_100:  # steps the agent dropped
            continue
        loss = 2.0 + (step % 97) / 97
        loss = {70_001: math.nan, 90_210: math.inf, 120_007: 55.0, 33_333: -4.0}.get(step, loss)
        chunk.append({
            "step": step, "rank": 0, "skipped": step % 1009 == 0, "loss": loss,
            "loss_scale": 2.0 ** (16 - step // 30_000), "grad_norm": 1.0,
            "lr": 1e-3 if step > 100_000 else None,
        })  # fmt: skip
        if len(chunk) == 2_000:
            run_id = send(sessions, "long", step, chunk)
            chunk = []
    if chunk:
        run_id = send(sessions, "long", LONG + 1, chunk)
    return run_id


def _direct_series(rows: list[Any], width: int) -> dict[str, list[Any]]:
    """The series' columns computed straight from raw rows: per `width`-step bucket a
    (first step, minima) point and, unless the bucket is one step, a (last step, maxima)."""
    buckets: dict[int, list[Any]] = {}
    for row in rows:
        buckets.setdefault(row.step // width, []).append(row)
    out: dict[str, list[Any]] = {"step": [], "skipped_count": [], **{f: [] for f in FIELDS}}
    for key in sorted(buckets):
        group = buckets[key]
        first, last, skipped, _, *extremes = _aggregate(group)
        points = [(first, 0, skipped)] + ([(last, 1, 0)] if first != last else [])
        for step, extreme, count in points:
            out["step"].append(step)
            out["skipped_count"].append(count)
            for field in FIELDS:
                out[field].append(extremes[2 * STEP_FLOAT_FIELDS.index(field) + extreme])
    return out


def _answer(answer: Any) -> dict[str, list[Any]]:
    def decoded(value: Any) -> Any:
        return _key(float(value)) if isinstance(value, str) else value

    return {
        "step": answer.step,
        "skipped_count": answer.skipped_count,
        **{f: [decoded(v) for v in getattr(answer, f)] for f in FIELDS},
    }


def test_the_series_equals_a_direct_min_max_per_bucket_at_every_zoom(
    sessions: sessionmaker[Session],
) -> None:
    run_id = _long_run(sessions)
    with sessions() as session:
        raw = list(session.scalars(select(Step).where(Step.run_id == run_id).order_by(Step.step)))
        assert len(raw) == LONG - 100
        windows = [
            (None, None, 500), (None, None, 40), (None, None, 6), (None, None, 4_000),
            (12_345, 67_890, 300), (39_999, 40_101, 20), (65_535, 131_073, 200),
            (100_000, 100_500, 100), (70_000, 70_002, 100), (30_001, 69_999, 2_000),
        ]  # fmt: skip
        for start, end, max_points in windows:
            answer = series.step_series(
                session, run_id, 0, start=start, end=end, max_points=max_points
            )
            width = answer.bucket_width
            assert len(answer.step) <= max_points, (start, end)
            in_window = [
                r
                for r in raw
                if (start is None or r.step >= start) and (end is None or r.step <= end)
            ]
            assert _answer(answer) == _direct_series(in_window, width), (start, end, width)
            if start is None:  # every skip and every step accounted for
                assert sum(answer.skipped_count) == sum(r.skipped for r in raw)
        zoomed = series.step_series(session, run_id, 0, start=30_001, end=69_999, max_points=2_000)
        assert zoomed.bucket_width % FINE_LEVEL == 0 and zoomed.bucket_width < ROLLUP_WIDTH
        whole = series.step_series(session, run_id, 0, max_points=500)
        assert whole.bucket_width % LAYER_LEVELS[1] == 0  # read from the 256-step level
        losses = _answer(whole)["loss"]
        assert "nan" in losses and math.inf in losses and 55.0 in losses and -4.0 in losses


def test_migrations_0012_and_0014_backfill_the_levels_ingest_writes(
    sessions: sessionmaker[Session], db_url: str
) -> None:
    """Levels of a run stored before revision 0012 or 0014 equal what ingest writes: ingest
    at head, go down to 0011 (the levels dropped, the 64-step rollups kept) or to 0013
    (the 16-step level dropped), and up again."""
    steps = [
        {"step": s, "rank": s % 2, "skipped": s % 7 == 0, "loss": math.nan if s == 5_000 else s,
         "loss_scale": 1.0, "grad_norm": None, "lr": -math.inf if s == 9_999 else 0.5}
        for s in range(0, 80_000, 37)
    ]  # fmt: skip
    run_id = 0
    for seq, first in enumerate(range(0, len(steps), 500)):
        run_id = send(sessions, "backfill", seq, steps[first : first + 500])

    def stored() -> dict[tuple[int, int, int], tuple[Any, ...]]:
        with sessions() as session:
            return _levels(session, run_id)

    ingested = stored()
    assert {level for _, level, _ in ingested} == set(STEP_LEVELS)
    for before in ("0011", "0013"):  # 0012 backfills the coarse levels, 0014 the fine one
        migrate.downgrade(db_url, before)
        if before == "0013":  # the level column only: the models' others may be newer
            with sessions() as session:
                levels = select(StepRollupLevel.level).where(StepRollupLevel.run_id == run_id)
                assert FINE_LEVEL not in set(session.scalars(levels))
        migrate.upgrade(db_url)
        assert stored() == ingested
