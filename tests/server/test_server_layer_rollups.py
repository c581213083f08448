"""Layer rollups (`ampwatch.server.layer_rollups`) against a direct aggregation of the raw
rows, on SQLite and PostgreSQL; whole-run and zoomed reads; aging raw rows into rollups.

The reference here is plain Python over the raw rows read back from `layer_stats`, one
layer and one bucket at a time, written apart from the module's numpy reduction.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rollup_property import ROLLUP_PROPERTY
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.agent.wire import WIRE_VERSION, encode_float
from ampwatch.server import cli, layer_reads, migrate
from ampwatch.server.ingest import ingest_batch
from ampwatch.server.layer_models import LayerRollup, LayerStat
from ampwatch.server.layer_rollups import LAYER_LEVELS, age_layer_stats
from ampwatch.server.models import Run
from ampwatch.server.packed import unpack_matrix
from ampwatch.server.schemas.wire import BatchIn

NAMES = ("a.weight", "b.weight", "c.weight", "d.weight")
STATS = ("zero_fraction", "max_abs_scaled")
_run_ids = itertools.count()

values = st.one_of(
    st.floats(allow_nan=False, allow_infinity=True, width=64),
    st.just(math.nan),
    st.floats(0, 1),
)


def send(sessions: sessionmaker[Session], run: str, seq: int, records: list[dict[str, Any]]) -> int:
    """Ingest one batch of layer-stat records ((step, rank, names, {stat: values}))."""
    batch = {
        "wire_version": WIRE_VERSION,
        "run": {"client_run_id": run, "name": run, "project": "default"},
        "stream": "0",
        "seq": seq,
        "layer_stats": [
            {"step": r["step"], "rank": r["rank"], "names": list(r["names"]),
             "stats": {s: [encode_float(v) for v in vs] for s, vs in r["stats"].items()}}
            for r in records
        ],
    }  # fmt: skip
    with sessions() as session:
        return ingest_batch(session, BatchIn.model_validate(batch)).run_id


@st.composite
def records(draw: st.DrawFn) -> list[list[dict[str, Any]]]:
    """Batches of layer-stat records: steps up to 20,000 (several levels), layers that
    appear part-way, re-sent steps (across batches) and non-finite values."""
    steps = draw(st.lists(st.integers(0, 20_000), min_size=1, max_size=40))
    out: list[dict[str, Any]] = []
    for step in steps:
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
        stats = draw(st.lists(st.sampled_from(STATS), min_size=1, max_size=2, unique=True))
        out.append({
            "step": step, "rank": draw(st.integers(0, 1)), "names": names,
            "stats": {s: draw(st.lists(values, min_size=len(names), max_size=len(names)))
                      for s in stats},
        })  # fmt: skip
    cuts = sorted(draw(st.lists(st.integers(0, len(out)), max_size=3)))
    # One record per (step, rank) per batch, as the agent sends them.
    batches = [out[a:b] for a, b in zip([0, *cuts], [*cuts, len(out)])]
    return [list({(r["step"], r["rank"]): r for r in batch}.values()) for batch in batches]


def _reference(
    rows: list[tuple[int, list[Any]]], level: int
) -> dict[int, tuple[int, int, int, list[Any], list[Any]]]:
    """bucket -> (first, last, samples, maxima, minima) per layer, in plain Python: None
    for nothing measured; a maximum is NaN when any sample is, a minimum only when all are."""
    buckets: dict[int, list[tuple[int, list[Any]]]] = {}
    for step, cells in rows:
        buckets.setdefault(step // level * level, []).append((step, cells))
    out = {}
    for start, group in buckets.items():
        width = max(len(cells) for _, cells in group)
        maxima: list[Any] = []
        minima: list[Any] = []
        for j in range(width):
            seen = [c[j] for _, c in group if j < len(c) and c[j] is not None]
            numbers = [v for v in seen if v != "nan"]
            nan = len(numbers) < len(seen)
            maxima.append(None if not seen else "nan" if nan else max(numbers))
            minima.append(min(numbers) if numbers else "nan" if seen else None)
        steps = [s for s, _ in group]
        out[start] = (min(steps), max(steps), len(group), maxima, minima)
    return out


def _cells(blob: bytes, width: int) -> list[Any]:
    values, missing = unpack_matrix([blob], width)
    return [
        None if m else "nan" if math.isnan(v) else float(v)
        for v, m in zip(values[0].tolist(), missing[0].tolist())
    ]


def _raw(session: Session, run_id: int, rank: int, stat: str) -> list[tuple[int, list[Any]]]:
    rows = session.execute(
        select(LayerStat.step, LayerStat.values)
        .where(LayerStat.run_id == run_id, LayerStat.rank == rank, LayerStat.stat == stat)
        .order_by(LayerStat.step)
    ).all()
    return [(step, _cells(blob, len(blob) // 8)) for step, blob in rows]


@ROLLUP_PROPERTY
@given(batches=records())
def test_rollups_equal_a_direct_aggregation_of_the_raw_rows(
    sessions: sessionmaker[Session], batches: list[list[dict[str, Any]]]
) -> None:
    run = f"prop-{next(_run_ids)}"
    run_id = 0
    for seq, batch in enumerate(batches):
        if batch:
            run_id = send(sessions, run, seq, batch)
    if not run_id:
        return
    with sessions() as session:
        stored = session.execute(select(LayerRollup).where(LayerRollup.run_id == run_id)).scalars()
        got = {
            (r.rank, r.stat, r.level, r.bucket_start): (
                r.first_step, r.last_step, r.samples,
                _cells(r.maxima, len(r.maxima) // 8), _cells(r.minima, len(r.minima) // 8),
            )
            for r in stored
        }  # fmt: skip
        expected = {}
        for rank, stat in itertools.product((0, 1), STATS):
            raw = _raw(session, run_id, rank, stat)
            for level in LAYER_LEVELS:
                for start, bucket in _reference(raw, level).items():
                    expected[(rank, stat, level, start)] = bucket
    # Rows of a bucket may be shorter than the run's later width: compare up to the
    # reference's width, the rest must be missing.
    assert got.keys() == expected.keys()
    for key, (first, last, samples, maxima, minima) in expected.items():
        g_first, g_last, g_samples, g_max, g_min = got[key]
        assert (g_first, g_last, g_samples) == (first, last, samples), key
        assert g_max[: len(maxima)] == maxima and set(g_max[len(maxima) :]) <= {None}, key
        assert g_min[: len(minima)] == minima and set(g_min[len(minima) :]) <= {None}, key


@pytest.mark.parametrize("huge", [[1e303, -1e303, 0.5, 1e300], [1.7e308, -1.7e308, 0.5, 1.7e308]])
def test_a_layer_statistic_near_the_float_limit_keeps_its_run_alerts(
    sessions: sessionmaker[Session], huge: list[float]
) -> None:
    """A zero_fraction of 1e303 from a faulty agent (the property test's floats found it):
    silent_underflow's baseline, rounded to 6 decimals for the state row, overflowed to inf
    (x * 1e6), and the batch's alert evaluation failed (PostgreSQL's JSON refuses
    Infinity); with 1.7e308, 2 x the baseline's deviation overflowed (numpy's warning, an
    error under the tests). A share outside [0, 1] now teaches no baseline: the layers'
    baselines are those of the one real share. The autouse `no_engine_failures` fixture
    fails this test on the engine's log line."""
    from ampwatch.server.alerts.evaluate import LAYERS_KEY
    from ampwatch.server.models import AlertState

    records = [
        {"step": step, "rank": 0, "names": NAMES, "stats": {"zero_fraction": huge}}
        for step in range(0, 50, 10)
    ]
    run_id = send(sessions, f"huge-{next(_run_ids)}", 0, records)
    with sessions() as session:
        state = session.scalar(
            select(AlertState.data).where(AlertState.run_id == run_id, AlertState.key == LAYERS_KEY)
        )
    assert state is not None
    assert state["base"] == [0.0, 0.0, 0.5, 0.0] and state["n"] == [0, 0, 5, 0]


def _long_run(sessions: sessionmaker[Session], steps: int = 20_000, every: int = 10) -> int:
    """One rank, 4 layers, samples every `every` steps; a NaN and a spike somewhere."""
    rng = np.random.default_rng(7)
    batch: list[dict[str, Any]] = []
    run_id = seq = 0
    for step in range(0, steps, every):
        cells = rng.random(len(NAMES)).tolist()
        if step == 7_010:
            cells[1] = math.nan
        if step == 12_340:
            cells[2] = 50.0
        batch.append({"step": step, "rank": 0, "names": NAMES, "stats": {"zero_fraction": cells}})
        if len(batch) == 200:
            run_id = send(sessions, "long", seq, batch)
            batch, seq = [], seq + 1
    if batch:
        run_id = send(sessions, "long", seq, batch)
    return run_id


def _direct_matrix(raw: list[tuple[int, list[Any]]], width: int) -> tuple[list[int], list[Any]]:
    """Bucket maxima by step // width, the first sampled step of each bucket."""
    buckets: dict[int, list[tuple[int, list[Any]]]] = {}
    for step, cells in raw:
        buckets.setdefault(step // width, []).append((step, cells))
    steps, rows = [], []
    for key in sorted(buckets):
        group = buckets[key]
        steps.append(group[0][0])
        row = []
        for j in range(len(NAMES)):
            column = [c[j] for _, c in group]
            row.append("NaN" if any(v == "nan" for v in column) else max(column))
        rows.append(row)
    return steps, rows


def _matrix(session: Session, run_id: int, **window: Any) -> Any:
    return layer_reads.layer_matrix(session, run_id, "zero_fraction", 0, max_layers=100, **window)


def test_whole_run_reads_rollups_and_zoom_reads_raw_rows(
    sessions: sessionmaker[Session],
) -> None:
    run_id = _long_run(sessions)
    with sessions() as session:
        raw = _raw(session, run_id, 0, "zero_fraction")
        whole = _matrix(session, run_id, max_steps=50)
        assert whole.step_width % 256 == 0 and len(whole.steps) <= 50  # from the rollups
        assert (whole.steps, whole.values) == _direct_matrix(raw, whole.step_width)
        assert "NaN" in {v for row in whole.values for v in row}
        assert 50.0 in {v for row in whole.values for v in row}
        # A zoomed window of fewer steps than max_steps: the raw samples, exactly.
        zoom = _matrix(session, run_id, start=12_001, end=12_999, max_steps=500)
        assert zoom.step_width == 1
        assert (zoom.steps, zoom.values) == (
            [s for s, _ in raw if 12_001 <= s <= 12_999],
            [c for s, c in raw if 12_001 <= s <= 12_999],
        )
        layer = layer_reads.layer_series(
            session, run_id, NAMES[2], 2, "zero_fraction", 0, max_points=40
        )
        exact = layer_reads.layer_series(
            session, run_id, NAMES[2], 2, "zero_fraction", 0, start=12_300, end=12_400,
            max_points=40,
        )  # fmt: skip
    assert layer.bucket_width % 64 == 0 and len(layer.step) <= 40
    assert max(v for v in layer.value if isinstance(v, float)) == 50.0
    column = [c[2] for _, c in raw]
    assert min(v for v in layer.value if isinstance(v, float)) == min(column)
    assert layer.step[0] == raw[0][0] and layer.step[-1] == raw[-1][0]
    assert exact.bucket_width == 1
    assert exact.step == list(range(12_300, 12_401, 10)) and 50.0 in exact.value


def test_aging_keeps_the_rollups_and_every_read_correct(
    sessions: sessionmaker[Session], db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _long_run(sessions)
    with sessions() as session:
        raw = _raw(session, run_id, 0, "zero_fraction")
        before = _matrix(session, run_id, max_steps=50)
        before_layer = layer_reads.layer_series(
            session, run_id, NAMES[1], 1, "zero_fraction", 0, max_points=40
        )
    assert cli.main(["age-layer-stats", "--keep-steps", "5000", "--database-url", db_url]) == 0
    assert "1 run(s) aged" in capsys.readouterr().out
    with sessions() as session:
        run = session.get(Run, run_id)
        assert run is not None
        assert age_layer_stats(session, run, keep_steps=5_000) == 0  # nothing left to age
        horizon = (19_990 - 5_000) // 64 * 64
        assert run.layer_stats_aged_before == horizon
        left = _raw(session, run_id, 0, "zero_fraction")
        assert left and left[0][0] >= horizon and left == [r for r in raw if r[0] >= horizon]
        # Whole-run reads: the same answers as before aging (they came from rollups).
        assert _matrix(session, run_id, max_steps=50) == before
        assert (
            layer_reads.layer_series(
                session, run_id, NAMES[1], 1, "zero_fraction", 0, max_points=40
            )
            == before_layer
        )
        # A zoom into the aged span: 64-step buckets, equal to the raw rows' maxima.
        zoom = _matrix(session, run_id, start=6_990, end=7_100, max_steps=500)
        assert zoom.step_width == 64
        expected = _direct_matrix([r for r in raw if 6_976 <= r[0] < 7_104], 64)
        assert (zoom.steps, zoom.values) == expected and zoom.values[0][1] == "NaN"
        # Beyond the horizon the raw rows are read as ever.
        recent = _matrix(session, run_id, start=19_000, max_steps=500)
        assert recent.step_width == 1 and recent.steps == [s for s, _ in raw if s >= 19_000]
    # A late sample below the horizon is merged into the stored extremes.
    send(sessions, "long", 1_000, [
        {"step": 3_001, "rank": 0, "names": NAMES, "stats": {"zero_fraction": [9.0] * 4}}
    ])  # fmt: skip
    with sessions() as session:
        zoom = _matrix(session, run_id, start=2_950, end=3_050, max_steps=500)
        assert zoom.step_width == 64
        direct = _direct_matrix([r for r in raw if 2_944 <= r[0] < 3_072], 64)[1]
        assert zoom.values == [[9.0] * 4, direct[1]]


def test_migration_0011_backfills_the_rollups_ingest_writes(
    sessions: sessionmaker[Session], db_url: str
) -> None:
    """Rollups of a run stored before revision 0011 equal what ingest writes: ingest at
    head, go down to 0010 (the rollups dropped, the raw rows kept) and up again."""
    run_id = _long_run(sessions, steps=6_000, every=7)
    send(sessions, "long", 500, [  # a re-sent sample, a NaN and a layer appearing late
        {"step": 3_003, "rank": 0, "names": [*NAMES, "e.weight"],
         "stats": {"zero_fraction": [math.nan, 2.0, 0.0, -1.0, 5.0]}},
    ])  # fmt: skip

    def stored() -> list[tuple[Any, ...]]:
        with sessions() as session:
            rows = session.execute(
                select(LayerRollup).where(LayerRollup.run_id == run_id)
            ).scalars()
            return sorted(
                (r.rank, r.stat, r.level, r.bucket_start, r.first_step, r.last_step,
                 r.samples, _cells(r.maxima, 5), _cells(r.minima, 5))
                for r in rows
            )  # fmt: skip

    ingested = stored()
    assert len(ingested) > 100
    migrate.downgrade(db_url, "0010")
    migrate.upgrade(db_url)
    assert stored() == ingested
