"""`fp8_risk`: the real agent's FP8 records of the outlier model (`fp8_scenario`) fed through
ingest and the alert engine, under the recipe the run declares in its run_start: it fires
for the layer the recipe does not fit, and for nothing else."""

from __future__ import annotations

from typing import Any

import pytest
from alert_feed import Feed
from fp8_scenario import outlier_records
from wire_batches import step_record

from ampwatch.agent.wire import LayerStatsRecord


def _start(recipe: str | None, time: float = 1_767_225_600.0) -> dict[str, Any]:
    data: dict[str, Any] = {"rank": 0}
    if recipe is not None:
        data["fp8_recipe"] = recipe
    return {"kind": "run_start", "step": None, "time": time, "data": data}


def _send(feed: Feed, records: list[LayerStatsRecord], first: int, last: int,
          events: list[dict[str, Any]] | None = None) -> None:  # fmt: skip
    """Steps first..last and their FP8 records, one batch per 20 steps."""
    for start in range(first, last + 1, 20):
        end = min(start + 19, last)
        feed.send([step_record(s, loss=2.0) for s in range(start, end + 1)],
                  [r for r in records if start <= r["step"] <= end],
                  events=events if start == first else [])  # fmt: skip


@pytest.fixture(scope="module")
def outliers() -> list[LayerStatsRecord]:
    """Samples at steps 1, 4, 7."""
    return outlier_records(7, 3)


def test_fp8_risk_fires_for_the_layer_per_tensor_scaling_flushes(
    feed: Feed, outliers: list[LayerStatsRecord]
) -> None:
    _send(feed, outliers, 1, 7, [_start("per_tensor")])
    (alert,) = feed.alerts(rule="fp8_risk")
    assert (alert.layer, alert.severity, alert.status) == ("2.weight", "warning", "firing")
    assert (alert.started_step, alert.fired_step) == (1, 4)  # for_samples 2: the 2nd sample
    values = alert.values
    assert (values["recipe"], values["role"], values["format"], values["scaling"],
            values["metric"]) == ("per_tensor", "weight", "e4m3", "tensor", "flush")  # fmt: skip
    assert values["value"] > 0.9 and values["limit"] == 0.01
    assert values["score"] == pytest.approx(values["value"] / 0.01)
    assert values["role_scores"]["act"] <= 1  # its input is ordinary: the weight fails
    assert alert.message.startswith(
        "layer 2.weight: under the declared FP8 recipe per_tensor, its weight (E4M3, per-tensor): 9"
    )
    assert "would flush to zero (limit 1.0%" in alert.message
    # The ordinary layer fits: no alert, and its count of failing samples stays 0.
    layers = feed.state("layers")
    assert layers["fp8_hits"][layers["names"].index("0.weight")] == 0
    assert feed.alerts(layer="0.weight") == []


def test_fp8_risk_is_quiet_without_a_declared_recipe_and_under_one_that_fits(
    feed: Feed, outliers: list[LayerStatsRecord]
) -> None:
    _send(feed, outliers, 1, 7, [_start(None)])
    assert feed.alerts() == []
    tiles = Feed(feed.sessions, "tiles")  # 1x128 tiles hold the outlier rows: it fits
    _send(tiles, outliers, 1, 7, [_start("tile_1x128")])
    assert tiles.alerts() == []
    unknown = Feed(feed.sessions, "unknown")  # not a recipe this collector knows
    _send(unknown, outliers, 1, 7, [_start("fp4_someday")])
    assert unknown.alerts() == []


def test_fp8_risk_resolves_when_the_layer_fits_again(feed: Feed) -> None:
    # Samples every 20 steps; the outlier channels are scaled back at step 101, so from the
    # sample at 101 per-tensor scaling fits; resolve_steps 200 resolves it at 301.
    records = outlier_records(341, 20, heal_at=101)
    _send(feed, records, 1, 341, [_start("per_tensor")])
    (alert,) = feed.alerts(rule="fp8_risk")
    assert (alert.layer, alert.fired_step) == ("2.weight", 21)
    assert (alert.status, alert.resolved_step) == ("resolved", 301)


def test_a_process_that_declares_another_recipe_resolves_the_old_risk(
    feed: Feed, outliers: list[LayerStatsRecord]
) -> None:
    _send(feed, outliers, 1, 7, [_start("per_tensor")])
    assert feed.rules() == {("fp8_risk", "2.weight")}
    resumed = [{**r, "step": r["step"] + 7} for r in outliers]  # steps 8, 11, 14
    _send(feed, resumed, 8, 14, [_start("tile_1x128", time=1_767_225_700.0)])
    (alert,) = feed.alerts(rule="fp8_risk")
    assert (alert.status, alert.resolved_step) == ("resolved", 7)  # as the old process ended
    assert feed.rules() == set()
