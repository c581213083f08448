"""The agent's bounds under pressure, unit-sized: what a full queue keeps, and that drops
are counted once (the fault tests in test_reliability_faults.py run the same end to end)."""

from __future__ import annotations

from ampwatch.agent import wire
from ampwatch.agent.delivery import DeliveryOptions
from ampwatch.agent.records import StepSample
from ampwatch.agent.transport import Sender

RUN: wire.RunRef = {"client_run_id": "bounds", "name": "bounds"}


def _step(step: int) -> StepSample:
    return StepSample(step=step, rank=0, fields=(), values=None, ready=None)


def _event(kind: str) -> wire.EventRecord:
    return {"kind": kind, "step": 0, "time": 1.7e9, "data": {}}  # type: ignore[typeddict-item]


def test_a_full_queue_of_steps_still_takes_the_run_end_event() -> None:
    sender = Sender(
        RUN, lambda body, headers: 200, max_queue=3, delivery=DeliveryOptions(spool=False)
    )  # not started
    for step in range(1, 4):
        sender.put(_step(step))
    sender.put(_step(4))  # no room, no layer sample to evict: the newcomer is dropped
    sender.put(_event("run_end"))  # an event evicts the oldest step instead
    queued = list(sender._queue.samples)
    assert [q.step for q in queued if isinstance(q, StepSample)] == [2, 3]
    assert queued[-1] == _event("run_end")
    counters = sender.counters()
    assert (counters["dropped_steps"], counters["dropped_events"]) == (2, 0)
