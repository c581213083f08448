"""Alert lifecycle: duration, dedupe, resolution, notifications, run health, escalation,
late and retried batches, several ranks, per-run settings, and the `no_data` sweep."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
from alert_feed import Feed, healthy, layer_sample
from sqlalchemy import event, func, select
from wire_batches import step_record

from ampwatch.server import lifecycle
from ampwatch.server.alerts import evaluate, sweep
from ampwatch.server.models import AlertConfig, Notification, Webhook
from ampwatch.server.step_models import Step


def configure(feed: Feed, rules: dict[str, dict[str, Any]]) -> None:
    """Per-run overrides, as `PUT /runs/{id}/alert-config` stores them."""
    with feed.sessions() as session:
        run_id = feed.run().id
        config = session.scalars(select(AlertConfig).where(AlertConfig.run_id == run_id)).first()
        if config is None:
            session.add(AlertConfig(run_id=run_id, rules=rules))
        else:
            config.rules = rules
        session.commit()


def add_webhook(feed: Feed, min_severity: str = "warning", project: str | None = None) -> None:
    with feed.sessions() as session:
        session.add(Webhook(url="http://hooks.invalid/x", format="generic", project=project,
                            min_severity=min_severity, enabled=True))  # fmt: skip
        session.commit()


def below_floor(first: int, count: int) -> list[Any]:
    return healthy(first, count, scale=0.5)


def test_one_alert_per_incident_notified_on_firing_and_resolution(feed: Feed) -> None:
    feed.send(healthy(1, 100))
    add_webhook(feed)  # every project, warning and above
    add_webhook(feed, min_severity="critical", project="default")
    feed.send(below_floor(101, 50))
    feed.send(below_floor(151, 50))  # the same incident: deduplicated
    (alert,) = feed.alerts()
    assert (alert.status, alert.started_step, alert.fired_step) == ("firing", 101, 101)
    assert feed.notifications() == [("loss_scale_collapse", "firing")] * 2
    assert feed.run().health == "critical"

    feed.send(healthy(201, 99))  # clear for 98 steps: still firing (resolve_steps=100)
    assert feed.alerts()[0].status == "firing"
    feed.send(healthy(300, 10))
    (alert,) = feed.alerts()
    assert (alert.status, alert.resolved_step) == ("resolved", 301)
    assert alert.resolved_at is not None and alert.fired_at is not None
    assert (
        feed.notifications()
        == [("loss_scale_collapse", "firing")] * 2 + [("loss_scale_collapse", "resolved")] * 2
    )
    assert feed.run().health == "ok"

    feed.send(below_floor(400, 5))  # a new incident: a new alert
    assert [a.status for a in feed.alerts()] == ["resolved", "firing"]


def test_warning_webhooks_do_not_get_critical_only_and_vice_versa(feed: Feed) -> None:
    add_webhook(feed, min_severity="critical")
    feed.send_steps(healthy(1, 1000, skips=dict.fromkeys(range(500, 1000, 10), 4096.0)))
    assert feed.rules() == {("skip_rate", "")}  # a warning
    assert feed.notifications() == []
    assert feed.run().health == "warning"


def test_for_steps_keeps_an_alert_pending_until_its_duration(feed: Feed) -> None:
    feed.send(healthy(1, 100))
    configure(feed, {"loss_scale_collapse": {"for_steps": 20}})
    feed.send(below_floor(101, 10))
    (alert,) = feed.alerts()
    assert (alert.status, alert.started_step, alert.fired_step) == ("pending", 101, None)
    assert feed.run().health == "ok"
    feed.send(below_floor(111, 20))
    (alert,) = feed.alerts()
    assert (alert.status, alert.fired_step) == ("firing", 121)


def test_disabling_a_rule_resolves_its_open_alert(feed: Feed) -> None:
    feed.send(healthy(1, 100) + below_floor(101, 5))
    configure(feed, {"loss_scale_collapse": {"enabled": False}})
    feed.send(below_floor(106, 5))
    assert [(a.status, a.resolved_step) for a in feed.alerts()] == [("resolved", 110)]
    assert feed.run().health == "ok"


def test_escalation_to_critical_is_notified_again(feed: Feed) -> None:
    add_webhook(feed)
    feed.send_steps(healthy(1, 299))
    feed.send(healthy(300, 1, act=60.0) + healthy(301, 2))
    assert feed.notifications() == [("activation_norm_spike", "firing")]
    feed.send(healthy(303, 2, skips={303: 2048.0, 304: 1024.0}) + healthy(305, 5, scale=1024.0))
    (alert,) = feed.alerts()
    assert alert.severity == "critical"
    assert feed.notifications() == [("activation_norm_spike", "firing")] * 2
    assert feed.run().health == "critical"


def test_late_and_retried_batches_do_not_corrupt_state(feed: Feed) -> None:
    feed.send(healthy(1, 299))
    before = feed.state()
    late = [step_record(s, skipped=True, loss=2.0, loss_scale=4096.0 / 2 ** (s - 99))
            for s in range(100, 130)]  # fmt: skip
    feed.send(late, stream="01d")  # older steps, another stream: stored, not evaluated
    assert feed.alerts() == []
    after = feed.state()
    assert after["last_step"] == 299 and after["skips"] == before["skips"]
    assert after["changes"] == before["changes"]


def test_scalar_rules_follow_rank_zero_and_layers_their_owner(feed: Feed) -> None:
    rank1 = [step_record(s, rank=1, skipped=True, loss=2.0, loss_scale=0.25)
             for s in range(1, 100)]  # fmt: skip
    feed.send(healthy(1, 99) + rank1)
    assert feed.alerts() == []
    assert feed.state()["rank"] == 0
    # Pipeline parallel: rank 1 alone reports the head's layer; its freeze still fires.
    for start in range(100, 900, 100):
        value = 0.0 if start < 600 else 1.0
        samples = [layer_sample(s, {"head.weight": value}, rank=1)
                   for s in range(start, start + 100, 20)]  # fmt: skip
        feed.send(healthy(start, 100), samples)
    (alert,) = feed.alerts()
    assert (alert.rule, alert.layer, alert.started_step) == ("silent_underflow", "head.weight", 600)


def test_no_data_sweep_fires_once_resolves_on_data_and_on_end(feed: Feed) -> None:
    add_webhook(feed)
    feed.send(healthy(1, 50))
    seen = feed.now
    with feed.sessions() as session:
        assert sweep(session, seen + timedelta(seconds=599)) == 0
        assert sweep(session, seen + timedelta(seconds=601)) == 1
        assert sweep(session, seen + timedelta(seconds=700)) == 0  # idempotent
    (alert,) = feed.alerts()
    assert (alert.rule, alert.status, alert.severity, alert.started_step) == (
        "no_data", "firing", "warning", 50
    )  # fmt: skip
    assert "no data for 601 s (limit 600 s)" in alert.message
    assert feed.run().health == "warning"

    feed.send(healthy(51, 10), now=seen + timedelta(seconds=900))  # the agent is back
    (alert,) = feed.alerts()
    assert (alert.status, alert.resolved_step) == ("resolved", 50)
    assert feed.notifications() == [("no_data", "firing"), ("no_data", "resolved")]

    configure(feed, {"no_data": {"stale_seconds": 30.0}})  # a per-run threshold
    with feed.sessions() as session:
        assert sweep(session, feed.now + timedelta(seconds=31)) == 1
    with feed.sessions() as session:
        lifecycle.end_run(session, feed.run().id)
    with feed.sessions() as session:
        assert sweep(session, feed.now + timedelta(seconds=60)) == 1  # ended: resolved
        assert sweep(session, feed.now + timedelta(seconds=6000)) == 0
    assert [a.status for a in feed.alerts()] == ["resolved", "resolved"]
    assert feed.run().health == "ok"


def test_a_process_resumed_from_an_earlier_checkpoint_is_evaluated_again(feed: Feed) -> None:
    feed.send_steps(healthy(1, 399))
    start = {"kind": "run_start", "step": None, "time": 1_767_225_700.0, "data": {"rank": 0}}
    # The resumed process replays from step 200: calibration again, then a collapse.
    cascade = [step_record(200 + i, skipped=True, loss=2.0, loss_scale=65536.0 / 2**i)
               for i in range(4)]  # fmt: skip
    feed.send(cascade + healthy(204, 96), events=[start])
    assert feed.alerts() == []  # the new process's calibration cascade is quiet
    feed.send(healthy(300, 10, scale=0.5))
    (alert,) = feed.alerts()
    assert (alert.rule, alert.started_step) == ("loss_scale_collapse", 300)
    other = {"kind": "run_start", "step": None, "time": 1_767_225_800.0, "data": {"rank": 3}}
    feed.send(healthy(310, 5, scale=0.5), events=[other])  # another rank's process: no reset
    assert feed.state()["calibrating"] is False


def test_every_write_of_a_runs_alerts_by_the_sweep_counts_a_change_of_the_run(
    feed: Feed,
) -> None:
    """The run's alerts page is tagged by `Run.version`: a sweep that writes an alert bumps
    it even when the run's health stays (here: critical, from a NaN loss), and a sweep that
    writes nothing does not."""
    steps = healthy(1, 50)
    steps[-1] = step_record(50, loss=math.nan, loss_scale=4096.0)
    feed.send(steps)
    assert feed.rules() == {("nan_loss", "")} and feed.run().health == "critical"
    seen, version = feed.now, feed.run().version
    with feed.sessions() as session:
        assert sweep(session, seen + timedelta(seconds=599)) == 0
    assert feed.run().version == version  # nothing written
    with feed.sessions() as session:
        assert sweep(session, seen + timedelta(seconds=601)) == 1
    assert feed.rules() == {("nan_loss", ""), ("no_data", "")}
    assert feed.run().health == "critical" and feed.run().version == version + 1
    with feed.sessions() as session:
        assert sweep(session, seen + timedelta(seconds=700)) == 0
    assert feed.run().version == version + 1


def test_concurrent_sweeps_fire_one_alert(feed: Feed) -> None:
    import threading

    feed.send(healthy(1, 10))
    later = feed.now + timedelta(hours=1)
    changed: list[int] = []

    def sweep_once() -> None:
        with feed.sessions() as session:
            changed.append(sweep(session, later))

    threads = [threading.Thread(target=sweep_once) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(changed) == 1
    assert [(a.rule, a.status) for a in feed.alerts()] == [("no_data", "firing")]


@pytest.mark.engine_failures_expected
def test_a_failing_evaluation_never_loses_the_batch(
    feed: Feed, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    feed.send(healthy(1, 100))

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("a bug in a rule")

    monkeypatch.setattr(evaluate, "_evaluate_steps", broken)
    feed.send(healthy(101, 5, scale=0.5))  # stored although evaluation failed
    assert "alert evaluation of run" in caplog.text
    assert feed.alerts() == [] and feed.state()["last_step"] == 100  # undone, not half-done
    monkeypatch.undo()
    feed.send(healthy(106, 5, scale=0.5))
    assert [a.rule for a in feed.alerts()] == ["loss_scale_collapse"]
    with feed.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Step)) == 110


def incident_series() -> tuple[list[Any], list[Any]]:
    """600 steps with a warm-up cascade, a spike with two halvings at 300, an embedding
    forecast to flush from step 1, a layer underflowing from 400 and one frozen from 450;
    layers sampled every 20 steps."""
    steps: list[Any] = []
    scale = 65536.0
    for step in range(1, 601):
        skipped = step <= 4 or step in (302, 303)
        if skipped:
            scale /= 2
        act = (10.0 + step / 100) * (1 + 0.02 * ((step * 7919) % 11 - 5) / 5)
        if 300 <= step <= 305:
            act *= 6
        steps.append(step_record(step, skipped=skipped, loss=2.0, loss_scale=scale,
                                 act_norm_mean=act, act_norm_max=2 * act))  # fmt: skip
    samples = []
    for step in range(1, 601, 20):
        zero = {"emb.weight": 0.7, "fc1.weight": 0.6 if step >= 400 else 0.02,
                "norm.weight": 1.0 if step >= 450 else 0.0}  # fmt: skip
        flush = {"emb.weight": 0.5, "fc1.weight": 0.01, "norm.weight": 0.01}
        samples.append(layer_sample(step, zero, extra={"flush_fraction": flush}))
    return steps, samples


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_alerts_do_not_depend_on_how_batches_were_cut(feed: Feed) -> None:
    """The same training data in batches of 7, 50 and 200 steps: identical alerts."""
    steps, samples = incident_series()
    seen = []
    for per_batch in (7, 50, 200):
        run = Feed(feed.sessions, f"cut-{per_batch}")
        for first in range(1, 601, per_batch):
            last = first + per_batch - 1
            run.send(steps[first - 1 : last], [x for x in samples if first <= x["step"] <= last])
        seen.append(sorted((a.rule, a.layer, a.started_step, a.fired_step, a.severity)
                           for a in run.alerts()))  # fmt: skip
    assert seen[0] == seen[1] == seen[2], seen
    rules = {(rule, layer) for rule, layer, *_ in seen[0]}
    assert rules == {
        ("activation_norm_spike", ""),
        ("underflow_risk", "emb.weight"),
        ("silent_underflow", "fc1.weight"),
        ("silent_underflow", "norm.weight"),
    }


def layer_batch(feed: Feed, start: int, zero: dict[str, float]) -> None:
    feed.send(healthy(start, 100), [layer_sample(s, zero) for s in range(start, start + 100, 20)])


def test_layers_of_one_incident_page_once(feed: Feed) -> None:
    """Per-(run, rule, layer) alerts, one notification per incident: 20 layers freezing
    fire one page (the lead's message counts them); the resolution is notified, for the
    lead, when the last layer recovers."""
    add_webhook(feed)
    names = [f"blocks.{i}.weight" for i in range(20)]
    for start in range(100, 400, 100):
        layer_batch(feed, start, dict.fromkeys(names, 0.01))
    layer_batch(feed, 400, dict.fromkeys(names, 1.0))
    firing = feed.alerts(status="firing")
    assert len(firing) == 20 and {a.rule for a in firing} == {"silent_underflow"}
    assert feed.notifications() == [("silent_underflow", "firing")]
    lead = firing[0]
    assert lead.values["layers_affected"] == 20
    assert "[20 layers of this run affected]" in lead.message
    assert {a.values.get("group_lead_id") for a in firing[1:]} == {lead.id}

    # Half recover: no page; the other half later: one resolution, for the lead.
    layer_batch(feed, 500, {n: 0.01 if i < 10 else 1.0 for i, n in enumerate(names)})
    layer_batch(feed, 600, {n: 0.01 if i < 10 else 1.0 for i, n in enumerate(names)})
    assert len(feed.alerts(status="resolved")) == 10
    assert feed.notifications() == [("silent_underflow", "firing")]
    for start in range(700, 900, 100):
        layer_batch(feed, start, dict.fromkeys(names, 0.01))
    assert len(feed.alerts(status="resolved")) == 20
    assert feed.notifications() == [("silent_underflow", t) for t in ("firing", "resolved")]
    with feed.sessions() as session:
        assert set(session.scalars(select(Notification.alert_id))) == {lead.id}

    # A later incident of the same rule pages again.
    layer_batch(feed, 900, dict.fromkeys(names[:3], 1.0))
    assert feed.notifications()[-1] == ("silent_underflow", "firing")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_storm_batch_without_transitions_rewrites_no_alert(feed: Feed) -> None:
    """Hundreds of open layer alerts: a batch in which none changes state writes no alert
    row (an alert is written on its transitions, not re-rendered every batch)."""
    names = [f"blocks.{i}.weight" for i in range(300)]
    for start in range(100, 400, 100):
        layer_batch(feed, start, dict.fromkeys(names, 0.01))
    layer_batch(feed, 400, dict.fromkeys(names, 1.0))
    assert len(feed.alerts(status="firing")) == 300
    statements: list[str] = []

    def capture(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    engine = feed.sessions.kw["bind"]
    event.listen(engine, "before_cursor_execute", capture)
    try:
        layer_batch(feed, 500, dict.fromkeys(names, 1.0))
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    written = ("UPDATE ALERTS", "INSERT INTO ALERTS", "DELETE FROM ALERTS")
    assert [s for s in statements if s.lstrip().upper().startswith(written)] == []
    assert len(feed.alerts(status="firing")) == 300


@pytest.mark.engine_failures_expected
def test_one_failing_rule_or_alert_costs_only_itself(
    feed: Feed, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rule that raises judges no more of its batch, an alert whose values cannot be
    stored keeps its place without them: the batch's other alerts and state are kept
    (one savepoint around all the rules once undid every alert of the batch)."""
    feed.send(healthy(1, 100))

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("a bug in a rule")

    def unstorable(s: int, loss: float, since: int) -> Any:
        return lambda: (f"loss {loss} at {s}", {"loss": object()})

    monkeypatch.setattr(evaluate.spikes, "judge", broken)
    monkeypatch.setattr(evaluate, "nan_detail", unstorable)
    steps = healthy(101, 5, scale=0.5)
    steps[2] = step_record(103, loss=math.nan, loss_scale=0.5, act_norm_mean=10.0)
    feed.send(steps)
    assert "alert rule loss_spike of run" in caplog.text
    assert "nan_loss| of run" in caplog.text
    alerts = {a.rule: a for a in feed.alerts()}
    assert sorted(alerts) == ["loss_scale_collapse", "nan_loss"]
    assert "loss scale 0.5 is below min_scale" in alerts["loss_scale_collapse"].message
    assert alerts["nan_loss"].values == {} and "could not be rendered" in alerts["nan_loss"].message
    assert feed.state()["last_step"] == 105
