"""A sharded run's global grad norm, combined on the collector from every rank's part
(`grad_sumsq`): the same stored norm, bit for bit, whatever the order and grouping in
which the ranks' batches arrive; NULL while a part is missing; NaN/Inf from an overflowing
part; the rollups as a fresh recomputation gives them; the grad-norm rule judging the
combined value whichever rank's batch completes it."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
from alert_feed import Feed
from sqlalchemy import select
from wire_batches import step_record

from ampwatch.agent.wire import StepRecord, encode_float
from ampwatch.server.rollups import refresh_step_rollups
from ampwatch.server.step_models import Step, StepRollup, StepRollupLevel

STEPS = 12
RANKS = 2
NAN_STEP, INF_STEP, MISSING_STEP = 5, 8, 11


def _shards(seed: int = 0) -> dict[tuple[int, int], np.ndarray]:
    """(step, rank) -> that rank's gradient shard: numbers over 6 orders of magnitude."""
    rng = np.random.default_rng(seed)
    return {
        (step, rank): rng.standard_normal(50 + 13 * rank) * 10.0 ** rng.integers(-3, 3)
        for step in range(1, STEPS + 1)
        for rank in range(RANKS)
    }


def _records(shards: dict[tuple[int, int], np.ndarray]) -> list[list[StepRecord]]:
    """Per rank, its step records as the agent sends them: rank 0 its step scalars with its
    part, rank 1 its part and skip flag only. Rank 1 overflows (NaN) at NAN_STEP, rank 0
    (Inf) at INF_STEP; rank 1's record of MISSING_STEP is lost."""
    per_rank: list[list[StepRecord]] = [[] for _ in range(RANKS)]
    for (step, rank), shard in sorted(shards.items()):
        sumsq = float(np.sum(shard * shard))
        if (step, rank) == (NAN_STEP, 1):
            sumsq = math.nan
        if (step, rank) == (INF_STEP, 0):
            sumsq = math.inf
        if (step, rank) == (MISSING_STEP, 1):
            continue
        floats: dict[str, Any] = {"loss": 2.0, "lr": 1e-3} if rank == 0 else {}
        record = step_record(step, rank=rank, skipped=step in (NAN_STEP, INF_STEP), **floats)
        record["grad_sumsq"] = encode_float(sumsq)
        record["grad_parts"] = RANKS
        per_rank[rank].append(record)
    return per_rank


def _batches(per_rank: list[list[StepRecord]], order: str, rng: random.Random) -> list[Any]:
    """(stream, records) batches: each rank's records cut into random runs, then the
    batches of all ranks interleaved per `order` (each rank's own batches stay in order)."""
    cut: list[list[tuple[str, list[StepRecord]]]] = []
    for rank, records in enumerate(per_rank):
        batches, start = [], 0
        while start < len(records):
            size = rng.randint(1, 5)
            batches.append((f"{rank:04x}", records[start : start + size]))
            start += size
        cut.append(batches)
    if order == "rank0_first":
        return cut[0] + cut[1]
    if order == "rank1_first":
        return cut[1] + cut[0]
    merged, queues = [], [list(b) for b in cut]
    while any(queues):
        queue = rng.choice([q for q in queues if q])
        merged.append(queue.pop(0))
    return merged


def _stored(feed: Feed) -> dict[tuple[int, int], float | None]:
    with feed.sessions() as session:
        run = feed.run()
        rows = session.execute(
            select(Step.rank, Step.step, Step.grad_norm).where(Step.run_id == run.id)
        )
        return {(rank, step): norm for rank, step, norm in rows}


def _rollups(feed: Feed, session: Any) -> list[str]:
    rows = []
    for model in (StepRollup, StepRollupLevel):
        rows += [
            repr(sorted((k, v) for k, v in vars(row).items() if not k.startswith("_")))
            for row in session.scalars(select(model).where(model.run_id == feed.run().id))
        ]
    return sorted(rows)


ORDERS = ["rank0_first", "rank1_first", *(f"shuffled{i}" for i in range(4))]


def test_parts_combine_to_the_same_norm_in_any_order(feed: Feed) -> None:
    shards = _shards()
    per_rank = _records(shards)
    results = []
    for index, order in enumerate(ORDERS):
        feed.client_run_id = f"run-{order}"
        for stream, records in _batches(per_rank, order, random.Random(index)):
            feed.send(records, stream=stream)
        stored = _stored(feed)
        results.append(stored)
        for step in range(1, STEPS + 1):
            assert stored.get((1, step)) is None  # parts only: rank 1 stores no norm
            norm = stored[(0, step)]
            if step == MISSING_STEP:
                assert norm is None, order  # a part never arrived
            elif step == NAN_STEP:
                assert norm is not None and math.isnan(norm), order
            elif step == INF_STEP:
                assert norm == math.inf, order
            else:  # the truth: the norm of the whole gradient, both shards concatenated
                whole = np.concatenate([shards[(step, r)] for r in range(RANKS)])
                assert norm == pytest.approx(float(np.linalg.norm(whole)), rel=1e-12), order
        # The rollups ingest kept up to date equal a recomputation from the stored rows.
        with feed.sessions() as session:
            kept = _rollups(feed, session)
            refresh_step_rollups(session, feed.run().id, [(0, 1, STEPS), (1, 1, STEPS)])
            assert _rollups(feed, session) == kept, order
            session.rollback()
    # Bit for bit the same norms whatever the order (NaN compared as text).
    assert len({repr(sorted(r.items())) for r in results}) == 1


def test_a_re_sent_part_recombines_the_same_norm(feed: Feed) -> None:
    per_rank = _records(_shards(1))
    feed.send(per_rank[0][:4], stream="0000")
    feed.send(per_rank[1][:4], stream="0001")
    before = _stored(feed)
    feed.send(per_rank[1][:4], stream="0002")  # rank 1's part again (a resumed process)
    feed.send(per_rank[0][:4], stream="0003")
    assert repr(sorted(_stored(feed).items())) == repr(sorted(before.items()))
    assert all(before[(0, s)] is not None for s in range(1, 5))


def _spiky_parts(rank: int, steps: range, spike_at: int) -> list[StepRecord]:
    """Each rank half of a norm of ~1 (16 at `spike_at`); rank 0 with its step scalars."""
    records = []
    for step in steps:
        norm = 16.0 if step == spike_at else 1.0 + 0.1 * (step % 3)
        floats: dict[str, Any] = {"loss": 2.0, "loss_scale": 4096.0} if rank == 0 else {}
        record = step_record(step, rank=rank, **floats)
        record["grad_sumsq"] = norm * norm / 2
        record["grad_parts"] = 2
        records.append(record)
    return records


@pytest.mark.parametrize("spiking", [True, False], ids=["spike", "healthy"])
@pytest.mark.parametrize("rank0_last", [True, False], ids=["rank0_last", "rank1_last"])
def test_the_grad_norm_rule_judges_a_sharded_norm_whichever_batch_completes_it(
    feed: Feed, rank0_last: bool, spiking: bool
) -> None:
    """A norm whose last part comes with the followed rank's records is judged with them;
    one completed later, by another rank's batch, is judged when that batch is stored
    (before: stored and charted, never judged, so a spike that rank 1's batch completed
    never fired). A healthy late norm is learned and fires nothing."""
    for start in range(1, 201, 50):
        batch = range(start, start + 50)
        feed.send(_spiky_parts(1, batch, 0), stream="0001")
        feed.send(_spiky_parts(0, batch, 0), stream="0000")
    spike_at = 201 if spiking else 0
    late = [(_spiky_parts(r, range(201, 203), spike_at), f"000{r}") for r in (0, 1)]
    for records, stream in late[::-1] if rank0_last else late:
        feed.send(records, stream=stream)
    assert _stored(feed)[(0, 201)] == pytest.approx(16.0 if spiking else 1.0)
    alerts = feed.alerts(rule="grad_norm_spike")
    if spiking:
        (alert,) = alerts
        assert alert.fired_step == 201 and alert.values["ratio"] >= 10
    else:
        assert alerts == []
    state = feed.state()["recent"]
    assert state["norm_step"] == 202  # both late norms judged and learned, in step order
    learned = state["grad_norms"]  # the combined norms were learned
    assert len(learned) >= 30 and all(0.99 < v < 1.21 for v in learned if v != 16.0)
    assert learned.count(pytest.approx(16.0)) == (1 if spiking else 0)


def test_a_norm_completed_after_a_later_one_was_judged_is_not_judged(feed: Feed) -> None:
    """The baseline learns in step order: a step's norm completed once a later step's norm
    was judged is stored but not judged (rank 1's batch of 201 lost, then re-sent)."""
    for start in range(1, 201, 50):
        batch = range(start, start + 50)
        feed.send(_spiky_parts(1, batch, 0), stream="0001")
        feed.send(_spiky_parts(0, batch, 0), stream="0000")
    feed.send(_spiky_parts(0, range(201, 202), 201), stream="0000")
    feed.send(_spiky_parts(1, range(202, 203), 201), stream="0001")
    feed.send(_spiky_parts(0, range(202, 203), 201), stream="0000")  # 202 judged in-batch
    feed.send(_spiky_parts(1, range(201, 202), 201), stream="0002")  # 201 completed late
    assert _stored(feed)[(0, 201)] == pytest.approx(16.0)
    assert feed.alerts(rule="grad_norm_spike") == []
    assert feed.state()["recent"]["norm_step"] == 202
