"""Each alert rule fires on its failing pattern, with the values and steps that explain it,
and stays quiet on the healthy pattern next to it; fed through `ingest_batch`."""

from __future__ import annotations

import math

import pytest
from alert_feed import Feed, calibration, finding, healthy, layer_sample
from wire_batches import step_record

from ampwatch.agent.wire import FP8_STATS, SCALER_CALIBRATED


def halving_skips(first: int, count: int, scale: float) -> list:
    """`count` consecutive skipped steps from `first`, each reporting half the last scale."""
    return [
        step_record(
            first + i,
            skipped=True,
            loss=2.0,
            loss_scale=scale / 2 ** (i + 1),
            act_norm_mean=10.0,
            act_norm_max=20.0,
        )
        for i in range(count)
    ]


def test_warm_up_cascade_and_a_healthy_run_stay_quiet(feed: Feed) -> None:
    feed.send_steps(calibration(1, start=2.0**32, halvings=12) + healthy(13, 2000, scale=2.0**20))
    assert feed.alerts() == []
    assert feed.run().health == "ok"
    assert feed.state()["calibrating"] is False


def test_collapse_fires_with_its_onset_and_explains_itself(feed: Feed) -> None:
    feed.send_steps(calibration(1) + healthy(5, 105))  # scale 4096 from step 5
    feed.send_steps(halving_skips(110, 13, 4096.0) + healthy(123, 5, scale=0.5))
    (alert,) = feed.alerts(rule="loss_scale_collapse")
    assert (alert.status, alert.severity, alert.layer) == ("firing", "critical", "")
    assert alert.started_step == 110  # the first skip: the onset, not the 10th skip
    assert alert.fired_step == 117  # the 8th halving: a fall of 2^fall_octaves
    assert "loss scale fell from 4096 to 0.5 (2^-13) between steps 110 and 127" in alert.message
    assert "13 consecutive skipped steps since step 110" in alert.message
    assert "below min_scale 1" in alert.message
    assert alert.values["peak_scale"] == 4096.0 and alert.values["loss_scale"] == 0.5
    assert feed.run().health == "critical"

    # Recovery: the scale is back above the floor and steps are clean again.
    feed.send_steps(healthy(128, 200, scale=4096.0))
    (alert,) = feed.alerts(rule="loss_scale_collapse")
    assert alert.status == "resolved"
    assert alert.resolved_step == 128 + 100  # resolve_steps of clear steps
    # 13 skips in the last 259 counted steps: the skip rate (a warning) still fires.
    assert feed.rules() == {("skip_rate", "")}
    assert feed.run().health == "warning"


def test_a_slow_fall_without_recovery_fires_but_a_recovered_one_does_not(feed: Feed) -> None:
    # One skip every 20 steps: never 10 in a row, but 9 unrecovered halvings (> 2^8).
    skips = {200 + 20 * i: 4096.0 / 2 ** (i + 1) for i in range(9)}
    records = healthy(1, 199) + healthy(200, 200, skips=skips)
    scale = 4096.0
    for record in records[199:]:  # the scale stays where each skip left it
        if record["skipped"]:
            scale = record["loss_scale"]  # type: ignore[assignment]
        record["loss_scale"] = scale
    feed.send_steps(records)
    (alert,) = feed.alerts(rule="loss_scale_collapse")
    assert alert.status == "firing" and alert.started_step == 200
    assert alert.values["fall_octaves"] == pytest.approx(9.0)
    assert "fell from 4096 to 8 (2^-9) between steps 200 and" in alert.message


def test_scale_below_minimum_fires_even_without_skips(feed: Feed) -> None:
    feed.send_steps(healthy(1, 100) + healthy(101, 5, scale=0.25))
    (alert,) = feed.alerts(rule="loss_scale_collapse")
    assert alert.started_step == 101 and "below min_scale 1 since step 101" in alert.message


def test_skip_rate_fires_at_ten_percent_and_not_at_a_healthy_rate(feed: Feed) -> None:
    feed.send_steps(healthy(1, 1000, skips=dict.fromkeys(range(100, 1000, 500), 4096.0)))
    assert feed.alerts() == []
    feed.send_steps(healthy(1000, 500, skips=dict.fromkeys(range(1000, 1500, 10), 4096.0)))
    (alert,) = feed.alerts(rule="skip_rate")
    assert (alert.severity, alert.status) == ("warning", "firing")
    assert alert.values["fraction"] > 0.05
    assert "were skipped" in alert.message
    assert feed.rules() == {("skip_rate", "")}  # constant scale: not a collapse


def test_activation_spike_is_a_warning_alone_and_critical_with_a_falling_scale(
    feed: Feed,
) -> None:
    feed.send_steps(healthy(1, 299))
    assert feed.alerts() == []
    spike = healthy(300, 1, act=60.0)
    feed.send(spike + healthy(301, 99))
    (alert,) = feed.alerts(rule="activation_norm_spike")
    assert (alert.severity, alert.started_step) == ("warning", 300)
    assert "norm 60.72 at step 300 is 6.1x its rolling median 10 (robust z" in alert.message

    # A second incident later: the spike comes with two halvings of the scale.
    feed.send_steps(healthy(400, 200))
    feed.send(healthy(600, 2, skips={600: 2048.0, 601: 1024.0}, act=80.0)
              + healthy(602, 10, scale=1024.0))  # fmt: skip
    alerts = feed.alerts(rule="activation_norm_spike")
    assert [a.status for a in alerts] == ["resolved", "firing"]
    assert alerts[1].severity == "critical"
    assert "OPT-175B" in alerts[1].message


def test_the_activation_rule_judges_the_norm_before_the_final_norm(feed: Feed) -> None:
    """With act_prenorm_* reported, a x5 rise there fires while the post-norm value, which
    the final LayerNorm holds flat, would not."""
    records = healthy(1, 200)
    for record in records:
        record["act_prenorm_mean"] = 10.0 * record["act_norm_mean"]
        record["act_prenorm_max"] = 20.0 * record["act_norm_mean"]
    for record in records[150:160]:
        record["act_prenorm_mean"] = 5 * record["act_prenorm_mean"]
    feed.send_steps(records)
    (alert,) = feed.alerts(rule="activation_norm_spike")
    assert (alert.started_step, alert.fired_step) == (151, 151)
    assert alert.values["act_norm"] > 400  # the pre-norm value (post-norm: ~10)


def test_a_spike_then_a_fall_escalates_to_critical(feed: Feed) -> None:
    feed.send_steps(healthy(1, 299))
    feed.send(healthy(300, 1, act=60.0) + healthy(301, 3)
              + healthy(304, 2, skips={304: 2048.0, 305: 1024.0})
              + healthy(306, 5, scale=1024.0))  # fmt: skip
    (alert,) = feed.alerts(rule="activation_norm_spike")
    assert alert.severity == "critical"
    assert alert.values["scale_fall_step"] == 305  # the second halving: a falling scale


def test_the_escalation_says_the_fall_it_judged_not_a_later_one_in_its_batch(
    feed: Feed,
) -> None:
    """Found by the batching property (test_server_alerts_batching): the escalation's
    message was rendered from the state at the batch's end, so a later fall in the same
    batch, long after the spike, showed as the signature's."""
    feed.send_steps(healthy(1, 299))
    feed.send(healthy(300, 1, act=60.0) + healthy(301, 3)
              + healthy(304, 2, skips={304: 2048.0, 305: 1024.0})
              + healthy(306, 94, scale=1024.0)
              + healthy(400, 2, skips={400: 512.0, 401: 256.0})
              + healthy(402, 5, scale=256.0))  # fmt: skip
    (alert,) = feed.alerts(rule="activation_norm_spike")
    assert (alert.values["scale_fall_step"], alert.values["loss_scale"]) == (305, 1024.0)
    assert "fell to 1024 at step 305" in alert.message


def test_one_halving_after_a_spike_is_not_a_falling_scale(feed: Feed) -> None:
    """A spiking step that overflows halves the scale once, as any single overflow does:
    that is not the OPT-175B signature (scale_fall_octaves=2)."""
    feed.send_steps(healthy(1, 299))
    feed.send(healthy(300, 1, act=60.0, skips={300: 2048.0}) + healthy(301, 20, scale=2048.0))
    (alert,) = feed.alerts(rule="activation_norm_spike")
    assert alert.severity == "warning"


def test_a_nan_batch_is_nan_loss_not_an_activation_spike(feed: Feed) -> None:
    """The nan_loss scenario: one corrupted batch (NaN loss and NaN norm, skipped, one
    halving), then recovery. It is nan_loss's incident; the norm did not spike."""
    feed.send_steps(healthy(1, 149))
    nan = step_record(150, skipped=True, loss=math.nan, loss_scale=1048576.0,
                      act_norm_mean=math.nan, act_norm_max=math.nan)  # fmt: skip
    feed.send([nan, *healthy(151, 99, scale=524288.0)])
    assert {a.rule for a in feed.alerts()} == {"nan_loss"}


def zero_fractions(step: int, **changed: float) -> dict[str, float]:
    """An embedding with ~70% structural zeros (+-5% by batch), two dense layers, and a
    masked tensor whose gradient is almost (never entirely) zero; `changed` overrides a
    layer (`fc1=0.6`)."""
    wobble = 0.05 * ((step * 31) % 7 - 3) / 3
    values = {"embed.weight": 0.7 + wobble, "fc1.weight": 0.02, "fc2.weight": 0.0,
              "masked.weight": 0.995}  # fmt: skip
    values.update({f"{layer}.weight": value for layer, value in changed.items()})
    return values


def sampled(start: int) -> range:
    """The agent's default layer sampling: every 20th step of a 100-step batch."""
    return range(start, start + 100, 20)


def feed_layers(feed: Feed, first: int, last: int, **changed: float) -> None:
    for start in range(first, last, 100):
        samples = [layer_sample(s, zero_fractions(s, **changed)) for s in sampled(start)]
        feed.send(healthy(start, 100), samples)


def test_silent_underflow_fires_per_layer_against_its_own_baseline(feed: Feed) -> None:
    feed_layers(feed, 100, 600)  # embed's 70% zeros and masked's 99.5% are structural
    assert feed.alerts() == []
    feed_layers(feed, 600, 800, fc1=0.6, fc2=1.0)
    alerts = {a.layer: a for a in feed.alerts(rule="silent_underflow")}
    assert set(alerts) == {"fc1.weight", "fc2.weight"}
    fc1, fc2 = alerts["fc1.weight"], alerts["fc2.weight"]
    # for_steps=40: the 3rd consecutive sample at one sample per 20 steps.
    assert (fc1.status, fc1.started_step, fc1.fired_step) == ("firing", 600, 640)
    assert fc1.values["zero_fraction"] == pytest.approx(0.6)
    assert fc1.values["baseline"] == pytest.approx(0.02, abs=1e-6)
    assert "60.0% of its gradients are exactly zero against a baseline of 2.0%" in fc1.message
    assert fc2.values["frozen"] is True and "(frozen)" in fc2.message
    feed_layers(feed, 800, 1000)
    assert {a.status for a in feed.alerts(rule="silent_underflow")} == {"resolved"}


def test_a_tensor_all_zero_from_its_first_sample_is_frozen(feed: Feed) -> None:
    """static_scale_too_small: LayerNorm gradients flush to exactly zero from step 1, so
    no healthy baseline ever exists; a whole tensor at zero fires anyway, while the
    embedding's 95-99% structural zeros stay quiet."""
    for start in range(1, 301, 100):
        samples = [layer_sample(s, {"norm.weight": 1.0, "embed.weight": 0.95 + 0.04 * (s % 2),
                                    "fc.weight": 0.9})
                   for s in range(start, start + 100, 20)]  # fmt: skip
        feed.send(healthy(start, 100), samples)
    (alert,) = feed.alerts(rule="silent_underflow")
    assert (alert.layer, alert.status, alert.started_step, alert.fired_step) == (
        "norm.weight", "firing", 1, 41
    )  # fmt: skip
    assert alert.values["frozen"] is True


def test_zeros_explained_by_skipped_steps_do_not_fire(feed: Feed) -> None:
    feed_layers(feed, 100, 600)
    for start in range(600, 800, 100):  # every sampled step is a skipped one
        skips = dict.fromkeys(range(start, start + 100, 20), 4096.0)
        samples = [layer_sample(s, zero_fractions(s, fc1=0.9)) for s in skips]
        feed.send(healthy(start, 100, skips=skips), samples)
    assert feed.alerts(rule="silent_underflow") == []


def test_a_pending_underflow_that_clears_before_its_duration_leaves_nothing(feed: Feed) -> None:
    feed_layers(feed, 100, 600)
    samples = [layer_sample(s, zero_fractions(s, fc1=0.6)) for s in (600, 620)]
    feed.send(healthy(600, 30), samples)  # 2 samples: 20 steps, less than for_steps=40
    (pending,) = feed.alerts()
    assert (pending.status, pending.layer, pending.started_step) == ("pending", "fc1.weight", 600)
    feed.send(healthy(630, 70), [layer_sample(s, zero_fractions(s)) for s in (640, 660, 680)])
    feed_layers(feed, 700, 800)
    assert feed.alerts() == []
    assert feed.notifications() == []


def test_underflow_risk_needs_a_loss_scale(feed: Feed) -> None:
    flush = {"fc1.weight": 0.3, "fc2.weight": 0.01}
    for start in range(100, 400, 100):
        samples = [layer_sample(s, flush, stat="flush_fraction") for s in sampled(start)]
        feed.send(healthy(start, 100), samples)
    (alert,) = feed.alerts(rule="underflow_risk")
    assert (alert.layer, alert.severity, alert.status) == ("fc1.weight", "warning", "firing")
    assert "30.0% of its scaled gradients would flush to zero in FP16" in alert.message

    bf16 = Feed(feed.sessions, "bf16-run")  # no scaler: the FP16 forecast is not its risk
    for start in range(100, 400, 100):
        steps = [step_record(s, loss=2.0, act_norm_mean=10.0) for s in range(start, start + 100)]
        samples = [layer_sample(s, flush, stat="flush_fraction") for s in sampled(start)]
        bf16.send(steps, samples)
    assert bf16.alerts() == []


def test_collapse_inhibits_new_underflow_alerts(feed: Feed) -> None:
    feed_layers(feed, 100, 600)
    feed.send(healthy(600, 5, scale=0.5))  # below min_scale: the collapse fires
    assert feed.rules() == {("loss_scale_collapse", "")}
    for start in range(605, 905, 100):
        samples = [layer_sample(s, zero_fractions(s, fc1=0.9)) for s in sampled(start)]
        feed.send(healthy(start, 100, scale=0.5), samples)
    assert feed.alerts(rule="silent_underflow") == []
    assert [a.rule for a in feed.alerts()] == ["loss_scale_collapse"]


def test_scale_floor_stall(feed: Feed) -> None:
    feed.send_steps(healthy(1, 200, scale=8.0))
    floor = [step_record(s, skipped=True, loss=2.0, loss_scale=2.0) for s in range(200, 260)]
    floor[0]["loss_scale"] = 4.0  # halvings until the floor (a scaler with a minimum)
    feed.send(floor)
    (alert,) = feed.alerts(rule="scale_floor_stall")
    assert alert.status == "firing" and alert.severity == "critical"
    assert alert.started_step == 201 and alert.fired_step == 250
    assert "pinned at 2" in alert.message


def run_start(**data: object) -> dict:
    return {"kind": "run_start", "step": None, "time": 1_767_225_700.0, "data": data}


def test_a_reported_floor_makes_a_skip_near_it_critical_and_a_stable_low_scale_quiet(
    feed: Feed,
) -> None:
    """fairseq's floor 1e-4 reported: a run steady at 2e-3 (2^4.3 above it) skipping now
    and then stays quiet, and so does a clean scale within 2^4 of the floor; the first skip
    there fires at once (not falling: one halving), and a skip at the floor is a stall at
    once."""
    feed.send(healthy(1, 10, scale=2e-3), events=[run_start(min_loss_scale=1e-4)])
    feed.send_steps(healthy(11, 995, scale=2e-3, skips={300: 2e-3, 700: 2e-3, 1000: 2e-3}))
    feed.send_steps(healthy(1006, 4, scale=1e-3))
    assert feed.alerts() == []
    feed.send([step_record(1010, skipped=True, loss=2.0, loss_scale=1e-3)])
    (alert,) = feed.alerts(rule="loss_scale_collapse")
    assert (alert.status, alert.fired_step, alert.started_step) == ("firing", 1010, 1006)
    assert "is skipping 2^3.3 above the scaler's floor 0.0001 since step 1006" in alert.message
    assert alert.values["min_loss_scale"] == 1e-4
    assert feed.alerts(rule="scale_floor_stall") == []
    feed.send([step_record(1011, skipped=True, loss=2.0, loss_scale=1e-4)])
    (stall,) = feed.alerts(rule="scale_floor_stall")
    assert (stall.status, stall.fired_step) == ("firing", 1011)


def test_without_a_reported_floor_a_new_process_falls_back_to_min_scale(feed: Feed) -> None:
    """A floor reported by one process is not the next one's: a run_start without it
    brings back min_scale (a single skip at 8e-4, not falling, stays quiet)."""
    feed.send(healthy(1, 10, scale=1.0), events=[run_start(min_loss_scale=1e-4)])
    assert feed.state()["min_loss_scale"] == 1e-4
    feed.send(healthy(11, 10, scale=8e-4), events=[run_start(min_loss_scale=None)])
    feed.send([step_record(21, skipped=True, loss=2.0, loss_scale=8e-4)])
    assert feed.state()["min_loss_scale"] is None
    assert feed.alerts(rule="loss_scale_collapse") == []


def test_nan_loss_is_split_from_gradient_overflow(feed: Feed) -> None:
    feed.send_steps(healthy(1, 199, skips={150: 2048.0}))  # an overflow skip, finite loss
    assert feed.alerts(rule="nan_loss") == []
    feed.send([step_record(200, skipped=True, loss=math.nan, loss_scale=2048.0), *healthy(201, 99)])
    (alert,) = feed.alerts(rule="nan_loss")
    assert (alert.status, alert.started_step, alert.values["loss"]) == ("firing", 200, "nan")
    feed.send_steps(healthy(300, 100))
    assert feed.alerts(rule="nan_loss")[0].status == "resolved"


def test_findings_fire_and_a_new_process_resolves_them(feed: Feed) -> None:
    feed.send(healthy(1, 10), events=[
        finding("fp16_params_without_scaler", 1, "fp16 params, no GradScaler"),
        finding("clip_before_unscale", 5),
        finding("bf16_in_use", 1),
    ])  # fmt: skip
    alerts = {a.rule: a for a in feed.alerts()}
    assert {r: (a.severity, a.status) for r, a in alerts.items()} == {
        "fp16_without_scaler": ("critical", "firing"),
        "clip_before_unscale": ("warning", "firing"),
    }
    assert "fp16 params, no GradScaler" in alerts["fp16_without_scaler"].message
    start = {"kind": "run_start", "step": None, "time": 1_767_225_700.0, "data": {}}
    feed.send(healthy(11, 10), events=[start])
    assert {a.status for a in feed.alerts()} == {"resolved"}
    assert feed.run().health == "ok"


def test_layer_only_batches_carry_the_resolution_across_batches(feed: Feed) -> None:
    feed_layers(feed, 100, 600)
    feed_layers(feed, 600, 800, fc2=1.0)
    (alert,) = feed.alerts(rule="silent_underflow")
    assert alert.status == "firing"
    for start in range(800, 1000, 20):  # one sample per batch, no step records
        feed.send(layer_stats=[layer_sample(start, zero_fractions(start))])
    (alert,) = feed.alerts(rule="silent_underflow")
    assert (alert.status, alert.resolved_step) == ("resolved", 900)


def test_a_flapping_layer_replaces_its_pending_alert_within_one_batch(feed: Feed) -> None:
    feed_layers(feed, 100, 600)
    feed.send(healthy(600, 100), [layer_sample(680, zero_fractions(680, fc1=0.6))])
    (first,) = feed.alerts()
    assert (first.status, first.started_step) == ("pending", 680)
    flapping = [  # clear at 700 (the stored pending goes), raised again at 720 and 740
        layer_sample(700, zero_fractions(700)),
        layer_sample(720, zero_fractions(720, fc1=0.6)),
        layer_sample(740, zero_fractions(740)),
        layer_sample(760, zero_fractions(760, fc1=0.6)),
    ]
    feed.send(healthy(700, 100), flapping)
    (alert,) = feed.alerts()
    assert (alert.status, alert.layer, alert.started_step) == ("pending", "fc1.weight", 760)


def test_fp8_readiness_records_are_not_gradient_samples(feed: Feed) -> None:
    """The agent sends FP8 readiness (wire.FP8_STATS) as layer-stats records named by the
    same parameters and at the same steps as the gradient samples. Were one judged first,
    it would mark the step as seen and the gradient sample after it would be ignored: a
    frozen layer would never fire."""
    fp8_stat = FP8_STATS[0]
    for start in range(1, 301, 100):
        samples = []
        for s in range(start, start + 100, 20):
            samples.append(layer_sample(s, {"norm.weight": 0.0, "fc.weight": 0.0}, stat=fp8_stat))
            samples.append(layer_sample(s, {"norm.weight": 1.0, "fc.weight": 0.1}))
        feed.send(healthy(start, 100), samples)
    (alert,) = feed.alerts(rule="silent_underflow")
    assert (alert.layer, alert.status, alert.started_step) == ("norm.weight", "firing", 1)


def test_a_process_whose_scaler_has_a_history_is_not_calibrating(feed: Feed) -> None:
    """A run_start with `scaler_calibrated` (an imported log excerpt that starts mid-run):
    12 skips at the process's first steps are a collapse, not warm-up; the same steps
    without it are warm-up calibration, and quiet."""
    start = {"kind": "run_start", "step": None, "time": 1.0,
             "data": {"rank": 0, SCALER_CALIBRATED: True}}  # fmt: skip
    feed.send(events=[start])
    feed.send_steps(halving_skips(1, 12, 16384.0))
    assert feed.state()["calibrating"] is False
    assert ("loss_scale_collapse", "") in feed.rules()
    fresh = Feed(feed.sessions, client_run_id="run-fresh")
    fresh.send(events=[{**start, "data": {"rank": 0}}])
    fresh.send_steps(halving_skips(1, 12, 16384.0))
    assert fresh.state()["calibrating"] is True and fresh.alerts() == []
