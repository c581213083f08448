"""A 100,000-step run replayed in 100-step batches: quiet while healthy, a collapse
injected near the end fires, and the alert engine's per-batch cost stays flat.

Flat is proven by counting, not timing: the SQL statements each batch executes and the
rows those statements read (each SELECT re-run as a count) are the same for batch 20 as
for batch 980. Wall time early vs late is a looser second check. SQLite only: the
PostgreSQL path runs the same statements (the rule tests cover both backends).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from alert_feed import Feed, layer_sample
from sqlalchemy import event
from wire_batches import step_record

from ampwatch.server import ingest, migrate
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.layer_rollups import LAYER_LEVELS, LEVEL_FACTOR

STEPS = 100_000
PER_BATCH = 100
INCIDENT = 99_000
LAYERS = [f"blocks.{i}.{part}.weight" for i in range(6) for part in ("attn", "mlp")]
LAYERS = ["embed.weight", *LAYERS, "head.weight"]


def realistic_series(seed: int = 0) -> list[Any]:
    """GradScaler from 2^16: a calibration cascade, then doubling every 2000 clean steps
    until an overflow at 2^17 halves it (~1 skip per 2000 steps); a decaying noisy loss; a
    slowly growing noisy final-layer norm. At INCIDENT: the norm spikes and 30 steps in a
    row overflow, halving the scale each time (the OPT-175B signature)."""
    rng = np.random.default_rng(seed)
    loss_noise = rng.normal(0, 0.02, STEPS + 1)
    act_noise = rng.normal(0, 0.02, STEPS + 1)
    records, scale, clean = [], 2.0**16, 0
    for step in range(1, STEPS + 1):
        skipped = step <= 5 or scale >= 2.0**17 or INCIDENT < step <= INCIDENT + 30
        if skipped:
            scale /= 2
            clean = 0
        else:
            clean += 1
            if clean == 2000:
                scale, clean = scale * 2, 0
        act = (10 + 5 * step / STEPS) * (1 + act_noise[step])
        if step == INCIDENT:
            act *= 8
        loss = (2 + 8 * math.exp(-step / 20_000)) * (1 + loss_noise[step])
        records.append(step_record(step, skipped=skipped, loss=loss, loss_scale=scale,
                                   act_norm_mean=act, act_norm_max=2 * act, lr=3e-4))  # fmt: skip
    return records


def layer_samples(first: int, rng: np.random.Generator) -> list[Any]:
    """Every 20 steps: an embedding with ~70% structural zeros, other layers ~1%."""
    samples = []
    for step in range(first, first + PER_BATCH, 20):
        zero = {name: float(np.clip(rng.normal(0.01, 0.003), 0, 1)) for name in LAYERS}
        zero["embed.weight"] = float(rng.normal(0.7, 0.03))
        flush = dict.fromkeys(LAYERS, 0.001)
        samples.append(layer_sample(step, zero, extra={"flush_fraction": flush}))
    return samples


class SqlCounter:
    """Statements executed, and rows read by the SELECTs among them (re-run as counts)."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, Any]] = []

    def __call__(self, _conn: Any, _cursor: Any, statement: str, parameters: Any,
                 _context: Any, _many: bool) -> None:  # fmt: skip
        self.statements.append((statement, parameters))

    def rows_read(self, engine: Any) -> int:
        total = 0
        with engine.connect() as connection:
            for statement, parameters in self.statements:
                if statement.lstrip().upper().startswith("SELECT"):
                    counted = f"SELECT count(*) FROM ({statement})"
                    total += connection.exec_driver_sql(counted, parameters).scalar() or 0
        return total


@pytest.fixture
def feed(sqlite_url: str) -> Iterator[tuple[Feed, Any]]:
    migrate.upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    yield Feed(make_sessionmaker(engine)), engine
    engine.dispose()


def test_100k_steps_quiet_then_the_collapse_fires_at_flat_cost(
    feed: tuple[Feed, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    run, engine = feed
    records = realistic_series()
    rng = np.random.default_rng(1)
    evaluate_seconds: list[float] = []
    evaluate = ingest.evaluate_batch

    def timed(*args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        evaluate(*args, **kwargs)
        evaluate_seconds.append(time.perf_counter() - started)

    monkeypatch.setattr(ingest, "evaluate_batch", timed)
    measured = {20: "early", 980: "late"}
    cost: dict[str, dict[str, Any]] = {}
    wall: list[float] = []
    for number, first in enumerate(range(1, STEPS + 1, PER_BATCH)):
        batch_steps = records[first - 1 : first - 1 + PER_BATCH]
        samples = layer_samples(first, rng)
        counter = SqlCounter()
        if number in measured:
            event.listen(engine, "before_cursor_execute", counter)
        started = time.perf_counter()
        run.send(batch_steps, samples)
        wall.append(time.perf_counter() - started)
        if number in measured:
            event.remove(engine, "before_cursor_execute", counter)
            cost[measured[number]] = {
                "statements": len(counter.statements),
                "rows_read": counter.rows_read(engine),
                "state_bytes": len(str(run.state("steps"))) + len(str(run.state("layers"))),
            }
        if first + PER_BATCH - 1 < INCIDENT:
            assert not run.alerts(), (first, [(a.rule, a.message) for a in run.alerts()])

    collapse = run.alerts(rule="loss_scale_collapse")
    assert [(a.status, a.started_step) for a in collapse] == [("firing", INCIDENT + 1)]
    assert "30 consecutive skipped steps" in collapse[0].message
    (spike,) = run.alerts(rule="activation_norm_spike")
    assert (spike.severity, spike.started_step) == ("critical", INCIDENT)
    assert run.run().health == "critical"

    early, late = cost["early"], cost["late"]
    print(f"\nper batch, early vs late: {early} vs {late}")
    assert late["statements"] == early["statements"]
    # A rollup level above the finest recomputes a touched bucket from its children: up to
    # LEVEL_FACTOR of them, fewer while the bucket is still filling, so the rows read vary
    # with where a batch falls in each level's bucket (per sampled statistic), bounded
    # whatever the run's length.
    phase = (LEVEL_FACTOR - 1) * (len(LAYER_LEVELS) - 1) * len(("zero_fraction", "flush_fraction"))
    assert late["rows_read"] <= early["rows_read"] + 2 + phase
    assert late["state_bytes"] <= early["state_bytes"] * 1.1
    early_ms = statistics.median(evaluate_seconds[10:110]) * 1000
    late_ms = statistics.median(evaluate_seconds[-110:-10]) * 1000
    early_wall = statistics.median(wall[10:110]) * 1000
    late_wall = statistics.median(wall[-110:-10]) * 1000
    print(f"alert engine per batch: {early_ms:.2f} ms early, {late_ms:.2f} ms late; "
          f"whole ingest {early_wall:.2f} ms early, {late_wall:.2f} ms late")  # fmt: skip
    assert late_ms < 3 * early_ms + 2  # loose: the machine is shared; the counts above are exact
