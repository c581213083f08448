"""A run resumed from a plan keeps both branches: the `resumed` event moves the steps after
its checkpoint to `abandoned_steps` (served at `/abandoned-steps`), and the live series, its
rollups and the run's totals hold the new branch only; a plan made after the resume answers
the live branch's incident -- on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
from alert_feed import Feed
from sqlalchemy import delete, select
from wire_batches import make_batch, step_record

from ampwatch.agent.wire import INGEST_PATH, decode_float
from ampwatch.server.advisor import restart_candidates
from ampwatch.server.db import make_engine, make_sessionmaker
from ampwatch.server.incident import AdvisorConfig
from ampwatch.server.resume_plan import resume_plan
from ampwatch.server.rollups import refresh_step_rollups
from ampwatch.server.step_models import RunStepTotals, StepRollup, StepRollupLevel

RUNS = "/api/v1/runs"
OLD_END, FROM_STEP, NEW_END, SECOND_FROM = 300, 150, 200, 100
NAN_STEP = 290  # in the abandoned tail: kept as NaN, not null


def _old_loss(step: int) -> float:
    return math.nan if step == NAN_STEP else 10.0 + step


def _new_loss(step: int) -> float:
    return 1.0 / step


class Sender:
    """Batches of one run over real HTTP, each process its own stream numbered from 0."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.seq: dict[str, int] = {}
        self.run_id = 0

    def send(self, stream: str, steps: list[Any], events: list[Any] | None = None) -> None:
        seq = self.seq.get(stream, 0)
        self.seq[stream] = seq + 1
        batch = make_batch(seq, stream=stream, steps=steps, events=events or [])
        answer = self.client.post(INGEST_PATH, content=json.dumps(batch))
        assert answer.status_code == 200, answer.text
        self.run_id = int(answer.json()["run_id"])

    def process(self, stream: str, first: int, last: int, loss: Any, resumed: int | None) -> None:
        """One agent process: its `resumed` event (rank 0, before any step), then its steps
        in batches of 64; every 7th step skipped."""
        events = []
        if resumed is not None:
            data = {"from_step": resumed}
            events = [{"kind": "resumed", "step": resumed, "time": 2.0, "data": data}]
        steps = [
            step_record(s, loss=loss(s), loss_scale=2.0**16, grad_norm=s / 10, skipped=s % 7 == 0)
            for s in range(first, last + 1)
        ]
        self.send(stream, steps[:64], events)
        for start in range(64, len(steps), 64):
            self.send(stream, steps[start : start + 64])


def _rollups(session: Any, run_id: int) -> list[str]:
    rows = []
    for model in (StepRollup, StepRollupLevel):
        rows += [
            repr(sorted((k, v) for k, v in vars(row).items() if not k.startswith("_")))
            for row in session.scalars(select(model).where(model.run_id == run_id))
        ]
    return sorted(rows)


def _loss(values: list[Any]) -> list[float]:
    return [decode_float(v) for v in values]


def test_a_resume_keeps_the_abandoned_tail_and_serves_the_new_branch(
    client: httpx.Client, collector: Any
) -> None:
    sender = Sender(client)
    sender.process("0a", 1, OLD_END, _old_loss, resumed=None)
    sender.process("0b", FROM_STEP + 1, NEW_END, _new_loss, resumed=FROM_STEP)
    run = f"{RUNS}/{sender.run_id}"

    # The live series: the old steps up to the checkpoint, then the new branch only.
    live = client.get(f"{run}/steps", params={"max_points": 100_000}).json()
    assert live["step"] == list(range(1, NEW_END + 1))
    expected = [_old_loss(s) if s <= FROM_STEP else _new_loss(s) for s in live["step"]]
    assert _loss(live["loss"]) == expected
    # Downsampled from the rollups: no bucket remembers an abandoned step.
    coarse = client.get(f"{run}/steps", params={"max_points": 8}).json()
    assert coarse["bucket_width"] > 1 and coarse["step"][-1] == NEW_END
    assert max(v for v in _loss(coarse["loss"]) if not math.isnan(v)) == 10.0 + FROM_STEP
    assert sum(coarse["skipped_count"]) == NEW_END // 7
    summary = client.get(run).json()
    assert summary["steps"] == NEW_END and summary["last_step"] == NEW_END

    # The abandoned tail, as recorded before the resume (NaN kept).
    tails = client.get(f"{run}/abandoned-steps").json()
    assert tails["left_off"] == 0 and len(tails["tails"]) == 1
    tail = tails["tails"][0]
    assert (tail["branch"], tail["from_step"]) == (1, FROM_STEP)
    assert tail["step"] == list(range(FROM_STEP + 1, OLD_END + 1))
    assert tail["loss"][tail["step"].index(NAN_STEP)] == "NaN"
    finite = [
        (s, v) for s, v in zip(tail["step"], _loss(tail["loss"]), strict=True) if s != NAN_STEP
    ]
    assert all(v == _old_loss(s) for s, v in finite)
    assert tail["skipped"] == [s % 7 == 0 for s in tail["step"]]
    assert tail["grad_norm"] == [s / 10 for s in tail["step"]]

    # A second resume, from earlier still: the first resume's branch is the abandoned one.
    sender.process("0c", SECOND_FROM + 1, SECOND_FROM + 10, _new_loss, resumed=SECOND_FROM)
    tails = client.get(f"{run}/abandoned-steps").json()["tails"]
    assert [(t["branch"], t["from_step"]) for t in tails] == [(1, FROM_STEP), (2, SECOND_FROM)]
    assert tails[1]["step"] == list(range(SECOND_FROM + 1, NEW_END + 1))
    live = client.get(f"{run}/steps", params={"max_points": 100_000}).json()
    assert live["step"][-1] == SECOND_FROM + 10
    assert client.get(f"{run}/abandoned-steps", params={"rank": 1}).json()["tails"] == []

    # The rollups ingest kept equal a recomputation from the stored steps.
    engine = make_engine(collector.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            kept = _rollups(session, sender.run_id)
            for model in (StepRollup, StepRollupLevel):
                session.execute(delete(model).where(model.run_id == sender.run_id))
            refresh_step_rollups(session, sender.run_id, [(0, 1, OLD_END)])
            assert _rollups(session, sender.run_id) == kept
            session.rollback()
            totals = session.get(RunStepTotals, (sender.run_id, 0))
            assert totals is not None
            assert (totals.steps, totals.last_step) == (SECOND_FROM + 10, SECOND_FROM + 10)
            skipped = sum(1 for s in range(1, SECOND_FROM + 11) if s % 7 == 0)
            assert totals.skipped_steps == skipped
    finally:
        engine.dispose()


def _checkpoints(first: int, last: int) -> list[Any]:
    return [
        {"kind": "checkpoint", "step": s, "time": 1.0 + s, "data": {"path": f"/c/{s}.pt"}}
        for s in range(first, last + 1)
        if s % 20 == 0
    ]


def _steps(first: int, last: int, nan_at: int) -> list[Any]:
    return [
        step_record(s, loss=math.nan if s == nan_at else 2.0, loss_scale=2.0**16)
        for s in range(first, last + 1)
    ]


def test_a_plan_after_a_resume_answers_the_new_incident(feed: Feed) -> None:
    """First incident: a NaN loss at step 90; resumed from the checkpoint at 60; a second
    NaN loss at 140. The plan names the second incident, the checkpoint before it, and none
    of the abandoned branch's checkpoints (80 was saved after the step resumed from)."""
    feed.send_steps(_steps(1, 95, nan_at=90), per_batch=95)
    feed.send(events=_checkpoints(1, 95))
    with feed.sessions() as session:
        first = resume_plan(session, feed.run().id, config=AdvisorConfig())
    assert (first.onset_step, first.onset_rule) == (90, "nan_loss")
    assert first.checkpoint is not None and first.checkpoint.step == 60

    resumed = {"kind": "resumed", "step": 60, "time": 500.0, "data": {"from_step": 60}}
    feed.send(_steps(61, 100, nan_at=0), events=[resumed], stream="5eee")
    feed.send(_steps(101, 145, nan_at=140), events=_checkpoints(61, 145), stream="5eee")
    with feed.sessions() as session:
        plan = resume_plan(session, feed.run().id, config=AdvisorConfig())
        listed = [c.step for c in restart_candidates(session, feed.run().id).candidates]
    assert (plan.onset_step, plan.onset_rule) == (140, "nan_loss")
    assert plan.checkpoint is not None and plan.checkpoint.step == 120
    assert plan.skip is not None and (plan.skip.start, plan.skip.end) == (121, 160)
    # The live branch's checkpoints only: 80 of the abandoned branch is gone, the new
    # process's 80 (saved after the resume) is judged once.
    assert sorted(listed) == [20, 40, 60, 80, 100, 120, 140]
