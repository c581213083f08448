"""The same runs judged the same on SQLite and on PostgreSQL: alerts, messages, values and
rule state. PostgreSQL's json refused the bare Infinity/NaN tokens SQLite kept (an alert at
a zero median, a NaN loss), and the savepoint around the rules then undid every other
alert of the batch: a 3,000-step FP16 run raised five rules on SQLite and two there."""

from __future__ import annotations

import itertools
import logging
import math
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from alert_feed import Feed
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker
from wire_batches import step_record

from ampwatch.agent import wire
from ampwatch.server import migrate
from ampwatch.server.db import make_engine, make_sessionmaker

pytestmark = pytest.mark.postgres

LAYERS = ("embed.weight", "fc1.weight", "head.weight")
#: The FP8 statistics of `per_tensor`, the recipe the streams' run_start may declare.
FP8_STATS = [wire.fp8_stat(role, fmt, "tensor", metric)
             for role, (fmt, _) in wire.FP8_RECIPES["per_tensor"].items()
             for metric in wire.FP8_METRICS]  # fmt: skip


@dataclass(frozen=True)
class Run:
    """A run's drawn shape (its repr is what a failure shows; `records` builds it)."""

    n: int
    seed: int
    scale: float
    floor: float | None
    fp8: bool
    spikes: frozenset[int]
    nans: frozenset[int]
    infs: frozenset[int]
    odd_scales: frozenset[int]
    storms: tuple[tuple[int, int], ...]
    zero_from: int | None
    zero_what: frozenset[str]
    warm_up: int
    cuts: tuple[int, ...]

    def records(self) -> list[dict[str, Any]]:
        """The run as wire records, in order: every rule family's inputs at the edges."""
        rng = random.Random(self.seed)
        start: dict[str, Any] = {"rank": 0, wire.MIN_LOSS_SCALE: self.floor}
        if self.fp8:
            start["fp8_recipe"] = "per_tensor"
        records: list[dict[str, Any]] = [
            {"kind": "run_start", "step": None, "time": 1_767_225_600.0, "data": start}
        ]
        stormy = {s for first, length in self.storms for s in range(first, first + length)}
        scale = self.scale
        for step in range(1, self.n + 1):
            skipped = step <= self.warm_up or step in stormy
            if skipped:
                scale /= 2
            elif step % 50 == 0:
                scale *= 2
            zero = self.zero_from is not None and step >= self.zero_from
            jump = 5.0 if step in self.spikes else 1.0
            loss = 0.0 if zero and "loss" in self.zero_what else (2.0 + 0.3 * rng.random()) * jump
            if step in self.nans:
                loss = math.nan
            elif step in self.infs:
                loss = rng.choice([math.inf, -math.inf])
            norm = (1.0 + rng.random()) * jump**3
            norm = 0.0 if zero and "grad_norm" in self.zero_what else norm
            if skipped:
                norm = rng.choice([math.inf, math.nan])
            act = 0.0 if zero and "act" in self.zero_what else (10.0 + rng.random()) * jump
            reported = rng.choice([math.nan, math.inf, 0.0]) if step in self.odd_scales else scale
            records.append(dict(step_record(step, skipped=skipped, loss=loss,
                                            loss_scale=reported, grad_norm=norm,
                                            act_norm_mean=act, act_norm_max=2 * act)))  # fmt: skip
            if step % 5 == 0:
                records.append(self._layer_sample(step, rng))
        return records

    def _layer_sample(self, step: int, rng: random.Random) -> dict[str, Any]:
        frozen = 1.0 if step > self.n // 2 else 0.1
        stats = {"zero_fraction": [0.05 + 0.01 * rng.random(), 0.1, frozen],
                 "flush_fraction": [rng.choice([0.0, 0.3, math.nan]), 0.0, 0.6 * rng.random()],
                 "subnormal_fraction": [0.0, rng.random() / 2, 0.0],
                 "max_abs_scaled": [1.0, 70000.0 * rng.random(), math.inf]}  # fmt: skip
        if self.fp8:
            stats.update({stat: [rng.choice([0.0, 0.01, 0.4, math.nan]) for _ in LAYERS]
                          for stat in FP8_STATS})  # fmt: skip
        return {"step": step, "rank": 0, "names": list(LAYERS),
                "stats": {k: wire.encode_floats(v) for k, v in stats.items()}}  # fmt: skip


@st.composite
def runs(draw: st.DrawFn) -> Run:
    """A start scale of 2^40, 1e-13, 1 or 2^-20, warm-up cascades and overflow storms
    halving it, NaN and +-Inf losses, NaN/Inf/0 scales, stretches of exactly-zero losses,
    grad norms or activation norms (zero medians), spikes, layer samples with NaN, frozen
    and underflowing layers, FP8 samples against a declared recipe, a reported floor."""
    n = draw(st.integers(40, 160))
    picks = st.frozensets(st.integers(1, n), max_size=10)
    return Run(
        n=n,
        seed=draw(st.integers(0, 2**32)),
        scale=draw(st.sampled_from([65536.0, 2.0**40, 1e-13, 1.0, 2.0**-20])),
        floor=draw(st.sampled_from([None, 1.0, 1e-14, 2.0**-30])),
        fp8=draw(st.booleans()),
        spikes=draw(picks),
        nans=draw(picks),
        infs=draw(picks),
        odd_scales=draw(picks),
        storms=tuple(draw(st.lists(st.tuples(st.integers(1, n), st.integers(1, 12)), max_size=3))),
        zero_from=draw(st.sampled_from([None, *range(1, n, 7)])),
        zero_what=draw(st.frozensets(st.sampled_from(["loss", "grad_norm", "act"]), min_size=1)),
        warm_up=draw(st.integers(0, 6)),
        cuts=tuple(draw(st.lists(st.integers(1, n + n // 5), max_size=8))),
    )


def _send(feed: Feed, records: list[dict[str, Any]], cuts: tuple[int, ...]) -> None:
    bounds = [0, *sorted({c for c in cuts if c < len(records)}), len(records)]
    for low, high in itertools.pairwise(bounds):
        part = records[low:high]
        feed.send(steps=[r for r in part if "skipped" in r],  # type: ignore[misc]
                  layer_stats=[r for r in part if "names" in r],  # type: ignore[misc]
                  events=[r for r in part if "kind" in r])  # fmt: skip


def _outcome(feed: Feed) -> tuple[list[tuple[Any, ...]], dict[str, Any], dict[str, Any]]:
    """Alerts, step state and layer state, alert ids as their place in onset order: an id is
    the database's (SQLite reuses a deleted pending alert's, a PostgreSQL sequence never
    does), so neither the ids nor the rows' id order are the same on both; what each alert
    says must be."""
    rows = sorted(
        feed.alerts(),
        key=lambda a: (
            a.started_step,
            a.rule,
            a.layer,
            -1 if a.fired_step is None else a.fired_step,
        ),
    )
    order = {alert.id: i for i, alert in enumerate(rows)}
    alerts = []
    for a in rows:
        values = dict(a.values)
        if "group_lead_id" in values:
            values["group_lead_id"] = order.get(values["group_lead_id"], -1)
        alerts.append((a.rule, a.layer, a.severity, a.status, a.started_step, a.fired_step,
                       a.resolved_step, a.message, values))  # fmt: skip
    steps = feed.state()
    for group in steps.get("groups", {}).values():
        group["lead"] = order.get(group["lead"], -1)
    return alerts, steps, feed.state("layers")


@pytest.fixture
def both(sqlite_url: str, postgres_url: str) -> Iterator[tuple[sessionmaker[Session], ...]]:
    """Sessions on a fresh SQLite file and a fresh PostgreSQL database, both migrated."""
    engines = []
    for url in (sqlite_url, postgres_url):
        migrate.upgrade(url)
        engines.append(make_engine(url))
    yield tuple(make_sessionmaker(engine) for engine in engines)
    for engine in engines:
        engine.dispose()


# No shrinking: an example takes ~0.3 s on the two databases.
@settings(max_examples=15, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])  # fmt: skip
@given(run=runs())
def test_sqlite_and_postgresql_judge_a_run_the_same(
    both: tuple[sessionmaker[Session], sessionmaker[Session]],
    run: Run,
    caplog: pytest.LogCaptureFixture,
) -> None:
    records, cuts = run.records(), run.cuts
    name = f"run-{uuid.uuid4().hex}"
    feeds = [Feed(sessions, client_run_id=name) for sessions in both]
    with caplog.at_level(logging.ERROR, logger="ampwatch.server.alerts"):
        for feed in feeds:
            _send(feed, records, cuts)
    failures = [r.getMessage() for r in caplog.records if r.name.startswith("ampwatch.server")]
    assert failures == [], failures[:3]
    on_sqlite, on_postgres = (_outcome(feed) for feed in feeds)
    assert on_postgres == on_sqlite, _difference(on_sqlite, on_postgres)
    for alert in on_sqlite[0]:  # one spelling of the non-finite floats: the wire's
        words = set(alert[7].replace(",", " ").replace(":", " ").split())
        assert not words & {"nan", "inf", "-inf"} and "infx" not in alert[7], alert[7]
        assert _finite_or_wire(alert[8]), alert[8]
    event(f"rules: {sorted({alert[0] for alert in on_sqlite[0]})}")


def _finite_or_wire(value: Any) -> bool:
    """Every float in `value` finite: a non-finite one is spelt as the wire spells it."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(map(_finite_or_wire, value.values()))
    if isinstance(value, list):
        return all(map(_finite_or_wire, value))
    return True


def _difference(sqlite: Any, postgres: Any) -> str:
    """What differs, short: a whole run is tens of kB."""
    lines = [f"SQLite only: {alert}" for alert in sqlite[0] if alert not in postgres[0]]
    lines += [f"PostgreSQL only: {alert}" for alert in postgres[0] if alert not in sqlite[0]]
    for index, part in ((1, "steps"), (2, "layers")):
        lines += [f"state {part}.{key}: {sqlite[index].get(key)} | {postgres[index].get(key)}"
                  for key in set(sqlite[index]) | set(postgres[index])
                  if sqlite[index].get(key) != postgres[index].get(key)]  # fmt: skip
    return "\n".join(lines)
