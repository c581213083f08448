"""The step rules judge each step against what came before it, never against its batch: the
same steps sent in one batch or cut anywhere into many give the same alerts, with the same
onsets, messages and values, and leave the same rule state behind."""

from __future__ import annotations

import itertools
import math
import uuid
from typing import Any

from alert_feed import Feed
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker
from wire_batches import step_record

from ampwatch.agent.wire import StepRecord


@st.composite
def step_streams(draw: st.DrawFn) -> list[StepRecord]:
    """A few hundred steps: a warm-up cascade or none, noisy loss, grad norm and activation
    norms with spikes, NaN losses, overflow storms halving the scale, regrowth."""
    n = draw(st.integers(60, 400))
    rng = draw(st.randoms(use_true_random=False))
    spikes = set(draw(st.lists(st.integers(1, n), max_size=8)))
    storms = draw(st.lists(st.tuples(st.integers(1, n), st.integers(1, 8)), max_size=3))
    stormy = {s for start, length in storms for s in range(start, start + length)}
    nans = set(draw(st.lists(st.integers(1, n), max_size=2)))
    warm_up = draw(st.integers(0, 6))
    scale, records = 65536.0, []
    for step in range(1, n + 1):
        skipped = step <= warm_up or step in stormy
        if skipped:
            scale /= 2
        elif step % 200 == 0:
            scale *= 2
        jump = 4.0 if step in spikes else 1.0
        loss = math.nan if step in nans else (2.0 + 0.3 * rng.random()) * jump
        act = (10.0 + rng.random()) * (3.0 if step in spikes else 1.0)
        norm = math.inf if skipped else (1.0 + 0.2 * rng.random()) * jump**2.5
        records.append(step_record(step, skipped=skipped, loss=loss, loss_scale=scale,
                                   grad_norm=norm, act_norm_mean=act,
                                   act_norm_max=2 * act))  # fmt: skip
    return records


def _outcome(feed: Feed) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
    alerts = [(a.rule, a.layer, a.severity, a.status, a.started_step, a.fired_step,
               a.resolved_step, a.message, a.values) for a in feed.alerts()]  # fmt: skip
    # In onset order, not row order: a rule with a `for` (loss_spike's one step) writes its
    # row when it fires, so within one batch rows of several rules may come in another order
    # than across a cut; what each alert says must not differ.
    alerts.sort(key=lambda a: (a[4], a[0], a[1], a[5] if a[5] is not None else -1))
    return alerts, feed.state()


# No shrinking: an example takes ~0.1 s, and shrinking one ran past the test timeout.
@settings(max_examples=40, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(records=step_streams(), cuts=st.lists(st.integers(1, 399), max_size=12))
def test_the_same_steps_in_one_batch_or_many_judge_the_same(
    sessions: sessionmaker[Session], records: list[StepRecord], cuts: list[int]
) -> None:
    whole = Feed(sessions, client_run_id=f"whole-{uuid.uuid4().hex}")
    whole.send(records)
    parts = Feed(sessions, client_run_id=f"parts-{uuid.uuid4().hex}")
    bounds = [0, *sorted({c for c in cuts if c < len(records)}), len(records)]
    for low, high in itertools.pairwise(bounds):
        parts.send(records[low:high])
    outcome, other = _outcome(whole), _outcome(parts)
    assert other == outcome, _difference(bounds, outcome, other)
    event(f"rules: {sorted({alert[0] for alert in outcome[0]})}")  # --hypothesis-show-statistics


def _difference(bounds: list[int], whole: Any, parts: Any) -> str:
    """What differs, short: a whole example is tens of kB of step records."""
    lines = [f"batches cut at {bounds}"]
    lines += [
        f"one batch only: {alert[:8]} {alert[8]}" for alert in whole[0] if alert not in parts[0]
    ]
    lines += [f"cut only: {alert[:8]} {alert[8]}" for alert in parts[0] if alert not in whole[0]]
    lines += [f"state {key}: {whole[1].get(key)} | {parts[1].get(key)}"
              for key in set(whole[1]) | set(parts[1])
              if whole[1].get(key) != parts[1].get(key)]  # fmt: skip
    return "\n".join(lines)
