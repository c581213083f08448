"""The early-warning rules (`server/alerts/precursors.py`) fire on their failing pattern,
stay quiet on the healthy one beside it, escalate with a grad-norm rise, and record on the
alert how many steps ahead of the event they were; fed through `ingest_batch` on SQLite
and PostgreSQL."""

from __future__ import annotations

from alert_feed import Feed, healthy, layer_sample
from wire_batches import step_record

from ampwatch.agent.wire import LayerStatsRecord, StepRecord


def adam_steps(first: int, count: int, *, rms: float = 1.0, norm: float = 1.0,
               scale: float | None = None) -> list[StepRecord]:  # fmt: skip
    """Applied steps whose update RMS and grad norm wobble +-10% around `rms`, `norm`."""
    out = []
    for step in range(first, first + count):
        wobble = 0.1 * ((step * 7919) % 11 - 5) / 5
        out.append(step_record(step, loss=2.0 * (1 + wobble / 5), loss_scale=scale,
                               adam_rms_max=rms * (1 + wobble), grad_norm=norm * (1 + wobble),
                               update_ratio_max=1e-3))  # fmt: skip
    return out


def test_update_rms_rise_warns_ahead_of_the_nan_and_records_its_lead(feed: Feed) -> None:
    feed.send_steps(adam_steps(1, 200) + adam_steps(201, 3, rms=3.2))
    (alert,) = feed.alerts()
    assert (alert.rule, alert.severity, alert.status, alert.fired_step) == (
        "update_rms_rise", "warning", "firing", 201,
    )  # fmt: skip
    assert alert.values["adam_rms_max"] == 3.2 * (1 + 0.1 * ((201 * 7919) % 11 - 5) / 5)
    assert "lead_steps" not in alert.values  # no event yet
    feed.send([step_record(205, loss=float("nan"), adam_rms_max=3.0, grad_norm=1.0)])
    (alert,) = feed.alerts(rule="update_rms_rise")
    assert alert.values["lead_steps"] == 4
    assert (alert.values["event_rule"], alert.values["event_step"]) == ("nan_loss", 205)
    # a later transition of the precursor keeps its lead
    feed.send_steps(adam_steps(206, 60, rms=3.0, norm=10.0))
    (alert,) = feed.alerts(rule="update_rms_rise")
    assert alert.severity == "critical" and alert.values["lead_steps"] == 4


def test_update_rms_rise_escalates_with_a_grad_norm_rise(feed: Feed) -> None:
    feed.send_steps(adam_steps(1, 200) + adam_steps(201, 1, rms=3.2, norm=3.5))
    (alert,) = feed.alerts()
    assert (alert.rule, alert.severity, alert.fired_step) == ("update_rms_rise", "critical", 201)
    assert "with the grad norm" in alert.message


def test_a_steady_update_rms_stays_quiet(feed: Feed) -> None:
    feed.send_steps(adam_steps(1, 600, rms=1.4))
    feed.send_steps(adam_steps(601, 50, rms=1.4, norm=4.0))  # a grad norm rise alone
    assert [a.rule for a in feed.alerts()] == []


def _declining(falls: list[int], grow_at: int | None = None) -> list[StepRecord]:
    """A clean FP16 run at scale 64 that halves at `falls` (skipped steps) and, at
    `grow_at`, doubles."""
    records, scale = [], 64.0
    for step in range(1, 400):
        skipped = step in falls
        scale = scale / 2 if skipped else scale * 2 if step == grow_at else scale
        records.append(step_record(step, skipped=skipped, loss=2.0, loss_scale=scale))
    return records


def test_scale_decline_warns_on_a_slow_slide_the_collapse_rule_misses(feed: Feed) -> None:
    feed.send_steps(_declining([150, 200, 250, 300]))  # 64 -> 4 over 150 steps
    (alert,) = feed.alerts()
    assert (alert.rule, alert.severity, alert.fired_step) == ("scale_decline", "warning", 250)
    assert alert.values["octaves"] == 3.0 and alert.values["from_step"] == 150
    feed.send([step_record(400, loss=float("inf"), loss_scale=4.0)])
    (alert,) = feed.alerts(rule="scale_decline")
    assert alert.values["lead_steps"] == 150


def test_a_cycling_scaler_stays_quiet(feed: Feed) -> None:
    # healthy DeepSpeed-Chat's shape: falls, then growth inside the window
    feed.send_steps(_declining([150, 200, 250, 300], grow_at=240))
    assert feed.alerts() == []


def test_flush_trend_warns_before_the_layer_freezes(feed: Feed) -> None:
    flush = {20: 0.0, 25: 0.004, 30: 0.03, 35: 0.2, 40: 0.6, 45: 0.6, 50: 0.6}
    zero = {20: 0.0, 25: 0.0, 30: 0.02, 35: 0.1, 40: 1.0, 45: 1.0, 50: 1.0}
    samples = [
        layer_sample(s, {"blocks.0.w": flush[s]}, stat="flush_fraction",
                     extra={"zero_fraction": {"blocks.0.w": zero[s]}})
        for s in flush
    ]  # fmt: skip
    feed.send(healthy(1, 45, scale=1024.0), samples[:5])
    alerts = {a.rule: a for a in feed.alerts()}
    trend = alerts["flush_trend"]
    assert (trend.layer, trend.severity, trend.fired_step) == ("blocks.0.w", "warning", 30)
    # silent_underflow holds from step 40 but waits for_samples (3) before it fires: a
    # pending alert may yet be dropped, so it is no event to take a lead against yet
    assert (alerts["silent_underflow"].started_step, alerts["silent_underflow"].status) == (
        40,
        "pending",
    )
    assert "lead_steps" not in trend.values
    feed.send(healthy(46, 55, scale=1024.0), samples[5:])
    alerts = {a.rule: a for a in feed.alerts()}
    assert (alerts["silent_underflow"].started_step, alerts["silent_underflow"].status) == (
        40,
        "firing",
    )
    assert alerts["flush_trend"].values["lead_steps"] == 10  # to the onset, not the firing


def test_a_flat_flush_share_stays_quiet(feed: Feed) -> None:
    samples = [layer_sample(s, {"w": 0.05}, stat="flush_fraction") for s in range(20, 400, 5)]
    feed.send(healthy(1, 400, scale=1024.0), samples)
    assert feed.alerts() == []


def test_flush_trend_fires_for_the_rising_layer_alone_and_resolves_once_it_is_clear(
    feed: Feed,
) -> None:
    """Of three layers, one rises (fires), one sits flat above `min_flush` (no rise: quiet),
    one sits at 0; the rising one falls back below `min_flush` and resolves once it stayed
    clear `resolve_steps` (100) -- the clear path of a many-layer sample."""
    rising = {20: 0.0, 25: 0.004, 30: 0.03}

    def sample(step: int) -> LayerStatsRecord:
        a = rising.get(step, 0.0)
        return layer_sample(step, {"a": a, "b": 0.05, "c": 0.0}, stat="flush_fraction")

    feed.send(healthy(1, 35, scale=1024.0), [sample(s) for s in (20, 25, 30, 35)])
    (alert,) = feed.alerts()
    assert (alert.rule, alert.layer, alert.status, alert.fired_step) == (
        "flush_trend", "a", "firing", 30,
    )  # fmt: skip
    feed.send(healthy(36, 130, scale=1024.0), [sample(s) for s in range(40, 131, 5)])
    assert feed.alerts()[0].status == "firing"  # clear since 35: 95 steps
    feed.send(healthy(131, 140, scale=1024.0), [sample(s) for s in range(135, 141, 5)])
    (alert,) = feed.alerts()
    assert (alert.layer, alert.status) == ("a", "resolved")
