"""`loss_collapse` (issue 31, OLMo #692): a loss or grad norm falling off a cliff to ~0 fires;
a run converging to a small loss, and one batch's outlier, stay quiet. Fed through ingest
and the alert engine, on SQLite and PostgreSQL (`feed`)."""

from __future__ import annotations

from alert_feed import Feed
from wire_batches import step_record

#: OLMo #692's three steps as its log prints them (loss, grad norm).
OLMO_692 = [(1, 12.18, 231.7), (2, 1.7872662283480167e-06, 0.0002), (3, 0.0, 7.725906669975302e-08)]


def test_olmo_692_loss_and_grad_norm_collapse_fires_critical(feed: Feed) -> None:
    feed.send([step_record(s, loss=loss, grad_norm=norm) for s, loss, norm in OLMO_692])
    (alert,) = feed.alerts()
    assert (alert.rule, alert.severity, alert.status) == ("loss_collapse", "critical", "firing")
    assert (alert.started_step, alert.fired_step) == (2, 3)
    assert alert.values["loss"] == 0.0 and alert.values["loss_median"] == 12.18
    assert alert.values["grad_norm_median"] == 231.7
    assert "the loss fell to 0 from its rolling median 12.18 at step 2" in alert.message


def test_the_same_collapse_fires_when_the_steps_come_one_batch_each(feed: Feed) -> None:
    """`follow` sends a step per batch: the state carries the median it fell from."""
    for s, loss, norm in OLMO_692:
        feed.send([step_record(s, loss=loss, grad_norm=norm)])
    (alert,) = feed.alerts(rule="loss_collapse")
    assert (alert.severity, alert.started_step, alert.fired_step) == ("critical", 2, 3)


def test_a_run_converging_to_a_tiny_loss_stays_quiet(feed: Feed) -> None:
    """The healthy neighbour: the loss halves every step from 12 to ~1e-9 (a memorised
    toy set), its grad norm with it: each value a few times below the last, never 1000x
    below its median in one interval."""
    feed.send_steps(
        [step_record(s, loss=12.0 / 2**s, grad_norm=200.0 / 2**s) for s in range(1, 34)]
    )
    assert feed.alerts() == []


def test_one_outlier_batch_is_not_a_collapse_and_a_lone_grad_norm_one_warns(feed: Feed) -> None:
    steady = [step_record(s, loss=3.0, grad_norm=1.5) for s in range(1, 41)]
    outlier = [step_record(41, loss=1e-7, grad_norm=1.5), step_record(42, loss=3.0, grad_norm=1.5)]
    feed.send(steady + outlier)
    assert feed.alerts() == []  # pending at 41, dropped at 42: no history
    vanished = [step_record(s, loss=3.0, grad_norm=1e-9) for s in (43, 44)]
    feed.send(vanished)
    (alert,) = feed.alerts()
    assert (alert.rule, alert.severity, alert.started_step, alert.fired_step) == (
        "loss_collapse", "warning", 43, 44,
    )  # fmt: skip
    assert "global grad norm fell to 1e-09 from its rolling median 1.5" in alert.message
