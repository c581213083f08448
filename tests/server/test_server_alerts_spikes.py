"""The rules the real-log corpus asked for (issue #13), on crafted step series fed through
ingest and the alert engine: each fires on its failure and stays quiet on its look-alike."""

from __future__ import annotations

from alert_feed import Feed, calibration, healthy
from wire_batches import step_record


def test_loss_spike_fires_on_a_jump_and_not_on_noise(feed: Feed) -> None:
    noisy = [step_record(s, loss=3.0 + 0.2 * ((s * 7) % 5 - 2), loss_scale=4096.0)
             for s in range(1, 400)]  # fmt: skip
    feed.send_steps(noisy)
    assert feed.alerts() == []  # +-0.4 around 3: ordinary noise
    # One batch's outlier, back at the next step (the NanoGPT speedrun records' step 919):
    # a hard batch, not a divergence: it never fires (a pending alert leaves no history).
    feed.send([step_record(400, loss=7.3, loss_scale=4096.0), *healthy(401, 5, loss=3.0)])
    assert feed.alerts(rule="loss_spike") == []
    # The loss held high at the next step: it fires there, its onset the first high step.
    feed.send([step_record(s, loss=7.3, loss_scale=4096.0) for s in (406, 407)])
    (alert,) = feed.alerts(rule="loss_spike")
    assert (alert.severity, alert.started_step, alert.fired_step) == ("warning", 406, 407)
    assert alert.values["ratio"] > 2 and "its rolling median 3" in alert.message


def test_a_logged_spike_that_stands_for_a_log_interval_fires_at_once(feed: Feed) -> None:
    """A log printing every 10 steps (Megatron's lm loss: the interval's mean; BigScience
    tr8-104B: 6.44 -> 11.42 at 7010, NaN later): one line covers 10 steps of training."""
    feed.send_steps([step_record(s, loss=6.4, loss_scale=2048.0) for s in range(10, 7010, 10)])
    assert feed.alerts() == []
    feed.send([step_record(7010, loss=11.4, loss_scale=2048.0),
               step_record(7020, loss=6.5, loss_scale=2048.0)])  # fmt: skip
    (alert,) = feed.alerts(rule="loss_spike")
    assert (alert.started_step, alert.fired_step) == (7001, 7010)


def test_grad_norm_spike_reads_applied_steps_only(feed: Feed) -> None:
    steps = [step_record(s, loss=2.0, loss_scale=4096.0, grad_norm=1.0 + 0.1 * (s % 3))
             for s in range(1, 200)]  # fmt: skip
    # A skipped step's norm is Inf (or a stale repeat): not a spike.
    steps.append(step_record(200, skipped=True, loss=2.0, loss_scale=4096.0,
                             grad_norm=float("inf")))  # fmt: skip
    feed.send_steps(steps)
    assert feed.alerts(rule="grad_norm_spike") == []
    feed.send([step_record(201, loss=2.0, loss_scale=2048.0, grad_norm=16.0)])
    (alert,) = feed.alerts(rule="grad_norm_spike")
    assert alert.fired_step == 201 and alert.values["ratio"] >= 10


def test_a_warm_up_cascade_is_quiet_but_a_burst_after_clean_steps_is_not(feed: Feed) -> None:
    # The run's own start: a cascade from the first step is calibration.
    feed.send_steps(calibration(1, start=2.0**20, halvings=6) + healthy(7, 300))
    assert feed.alerts() == []
    # A resumed process whose restored scaler gives two clean steps, then 6 of 7 skipped
    # (BigScience tr8b-104B): an incident, at a scale far above 1.
    start = {"kind": "run_start", "step": None, "time": 1_767_225_700.0, "data": {"rank": 0}}
    burst = healthy(400, 2, scale=2.0**20) + [
        step_record(402 + i, skipped=i != 4, loss=4.4, loss_scale=2.0 ** (20 - min(i, 5)))
        for i in range(7)
    ]
    feed.send(burst, events=[start])
    (alert,) = feed.alerts(rule="overflow_burst")
    assert (alert.severity, alert.started_step, alert.fired_step) == ("critical", 402, 404)
    assert "6 of the 7 steps 402-408 were skipped" in alert.message


def test_overflows_each_cured_by_a_halving_are_not_a_burst_but_three_in_a_row_are(
    feed: Feed,
) -> None:
    # DeepSpeed-Chat's healthy reward model (FP16_Optimizer, no hysteresis): skips at 483,
    # 486 and 487 (512 -> 64), applied steps between: each halving cured its overflow.
    feed.send_steps(calibration(1, start=65536.0, halvings=10) + healthy(11, 470, scale=512.0))
    cured = [step_record(481 + i, skipped=i in (2, 5, 6), loss=2.0,
                         loss_scale=512.0 / 2 ** sum(j in (2, 5, 6) for j in range(i)))
             for i in range(8)]  # fmt: skip
    feed.send(cured + healthy(489, 40, scale=64.0))
    assert feed.alerts(rule="overflow_burst") == []
    # Three in a row later in the same run: the gradients outgrow each halving.
    storm = [step_record(600 + i, skipped=True, loss=2.0, loss_scale=64.0 / 2**i)
             for i in range(3)]  # fmt: skip
    feed.send(storm)
    (alert,) = feed.alerts(rule="overflow_burst")
    assert (alert.severity, alert.started_step, alert.fired_step) == ("critical", 600, 602)


def test_a_stable_low_scale_is_not_a_collapse_but_a_falling_one_is(feed: Feed) -> None:
    # fairseq at 0.5 for a long time, one overflow per "epoch" (halving to 0.25, regrowth).
    records = healthy(1, 3000, scale=0.5, skips=dict.fromkeys(range(500, 3000, 700), 0.5))
    feed.send_steps(records)
    assert feed.alerts() == []
    falling = [step_record(3001 + i, skipped=True, loss=2.0, loss_scale=0.5 / 2**i)
               for i in range(2)]  # fmt: skip
    feed.send(falling)
    (alert,) = feed.alerts(rule="loss_scale_collapse")
    assert alert.fired_step == 3002 and "loss scale 0.25 is below min_scale 1" in alert.message


def test_a_floored_scaler_stalls_at_once(feed: Feed) -> None:
    """'Attempted loss scale: 1, reducing to 1': three skips at an unchanged scale of 1."""
    feed.send_steps(healthy(1, 99, scale=1.0))
    feed.send([step_record(s, skipped=True, loss=2.0, loss_scale=1.0) for s in range(100, 104)])
    (alert,) = feed.alerts(rule="scale_floor_stall")
    assert (alert.started_step, alert.fired_step) == (100, 102)


def test_layer_rules_count_their_duration_in_samples(feed: Feed) -> None:
    """Sampled every 5 steps, an underflow fires at its 3rd sample (onset + 10), not 40
    steps later: the duration is in samples, so denser sampling pages sooner."""
    from alert_feed import layer_sample

    def sample(step: int, fc1: float) -> dict:  # type: ignore[type-arg]
        return layer_sample(step, {"fc1.weight": fc1, "fc2.weight": 0.01})

    for start in range(1, 201, 100):
        feed.send(healthy(start, 100), [sample(s, 0.02) for s in range(start, start + 100, 5)])
    feed.send(healthy(201, 40), [sample(s, 0.8) for s in range(201, 241, 5)])
    (alert,) = feed.alerts(rule="silent_underflow")
    assert (alert.layer, alert.started_step, alert.fired_step) == ("fc1.weight", 201, 211)


def test_the_underflow_forecast_judges_fp16_without_a_scaler(feed: Feed) -> None:
    """No loss scale reported, but the agent found FP16 without a scaler: the forecast (at
    S = 1) is the run's own risk. A subnormal share of 60% on 3 samples fires; a BF16 run
    with the same numbers (no finding) is not judged."""
    from alert_feed import finding, layer_sample

    def sample(step: int, subnormal: float) -> dict:  # type: ignore[type-arg]
        return layer_sample(step, {"fc1.weight": 0.0}, stat="flush_fraction",
                            extra={"subnormal_fraction": {"fc1.weight": subnormal}})  # fmt: skip

    steps = [step_record(s, loss=2.0) for s in range(1, 101)]
    drifting = [sample(s, 0.02 if s < 50 else 0.6) for s in range(1, 101, 5)]
    bf16 = Feed(feed.sessions, "bf16-run")
    bf16.send(steps, drifting)
    assert bf16.alerts() == []
    feed.send(steps, drifting, events=[finding("fp16_params_without_scaler", 0)])
    (alert,) = feed.alerts(rule="underflow_risk")
    assert (alert.started_step, alert.fired_step) == (51, 61)
    assert "60.0% sit in FP16's subnormal range" in alert.message
