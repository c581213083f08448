"""What a live collector stored for one run, read back through its HTTP API, and the
comparisons every framework test makes against the framework's own ground truth."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from ampwatch.agent import wire


@dataclass
class Truth:
    """Per optimizer step, read in the framework's own hooks (values or None)."""

    skipped: list[bool] = field(default_factory=list)
    loss_scale: list[float | None] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    #: The norm of the gradients the loop's clip left (compared when the test records it).
    grad_norm_clipped: list[float] = field(default_factory=list)
    #: step -> {parameter name: zero fraction of its gradient}
    zero_fraction: dict[int, dict[str, float]] = field(default_factory=dict)


def stored_run(url: str, name: str) -> dict[str, Any]:
    """Steps (columns, undownsampled), zero-fraction matrix and events of run `name`."""
    with httpx.Client(base_url=f"{url}/api/v1", timeout=10) as api:
        runs = api.get("/runs").json()["runs"]
        (run,) = [r for r in runs if r["name"] == name]
        run = api.get(f"/runs/{run['id']}").json()
        steps = api.get(f"/runs/{run['id']}/steps", params={"max_points": 100_000}).json()
        layers = api.get(f"/runs/{run['id']}/layers", params={"stat": "zero_fraction"}).json()
        events = api.get(f"/runs/{run['id']}/events").json()["events"]
    return {"run": run, "steps": steps, "layers": layers, "events": events}


def _mismatch(stored: list[Any], expected: list[float | None], rel: float) -> str | None:
    """The first step whose stored value differs from the truth, described, or None."""
    for step, (got, want) in enumerate(zip(stored, expected, strict=True), start=1):
        value = wire.decode_float(got)
        if want is None or value is None:
            same = want is value
        elif math.isnan(want):
            same = math.isnan(value)
        elif math.isinf(want):
            same = value == want
        else:
            same = value == pytest.approx(want, rel=rel, abs=1e-12)
        if not same:
            return f"step {step}: stored {value!r}, truth {want!r}"
    return None


def assert_matches(stored: dict[str, Any], truth: Truth, *, rel: float = 1e-5) -> None:
    """Step by step: one record per optimizer step, exact skips and scales, lr, the
    undivided loss, the pre-clip grad norm (and the post-clip one where the truth has it),
    and the sampled steps' zero fractions."""
    steps = stored["steps"]
    count = len(truth.skipped)
    assert steps["step"] == list(range(1, count + 1))
    assert steps["skipped"] == truth.skipped
    assert _mismatch(steps["loss_scale"], truth.loss_scale, 0.0) is None, _mismatch(
        steps["loss_scale"], truth.loss_scale, 0.0
    )
    assert _mismatch(steps["lr"], truth.lr, 1e-12) is None, _mismatch(steps["lr"], truth.lr, 1e-12)
    assert _mismatch(steps["loss"], truth.loss, rel) is None, _mismatch(
        steps["loss"], truth.loss, rel
    )
    assert _mismatch(steps["grad_norm"], truth.grad_norm, rel) is None, _mismatch(
        steps["grad_norm"], truth.grad_norm, rel
    )
    if truth.grad_norm_clipped:
        clipped = _mismatch(steps["grad_norm_clipped"], truth.grad_norm_clipped, rel)
        assert clipped is None, clipped
    layers = stored["layers"]
    assert layers["steps"] == sorted(truth.zero_fraction)
    for step, row in zip(layers["steps"], layers["values"], strict=True):
        # A layer the truth has no gradient of at this step (a Linear of another optimizer,
        # known to the run through its FP8 readiness records) has no zero fraction: null.
        measured = truth.zero_fraction[step]
        stored_row = dict(zip(layers["layers"], row, strict=True))
        assert {n for n, v in stored_row.items() if v is not None} == set(measured), step
        expected = {name: stored_row[name] for name in measured}
        assert expected == pytest.approx(measured, abs=1e-12), f"zero fractions at step {step}"
    kinds = [e["kind"] for e in stored["events"]]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
