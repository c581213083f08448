"""Test doubles for the agent: an in-memory collector that decodes what the agent sends."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from ampwatch.agent import wire
from ampwatch.agent.delivery import DeliveryOptions
from ampwatch.agent.records import LayerSample, StepSample


class FakeCollector:
    """A transport (bytes, headers) -> status that keeps every decoded batch it accepts."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.batches: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.attempts = 0
        self._statuses = list(statuses or [])

    def __call__(self, body: bytes, headers: dict[str, str]) -> int:
        self.attempts += 1
        status = self._statuses.pop(0) if self._statuses else 200
        if 200 <= status < 300:
            self.batches.append(json.loads(gzip.decompress(body)))
            self.headers.append(headers)
        return status

    def steps(self) -> list[dict[str, Any]]:
        return [record for batch in self.batches for record in batch["steps"]]

    def layer_stats(self) -> list[dict[str, Any]]:
        """The gradient-range records (FP8 readiness records: `fp8_records`)."""
        return [r for r in self._layer_records() if not _is_fp8(r)]

    def fp8_records(self) -> list[dict[str, Any]]:
        return [r for r in self._layer_records() if _is_fp8(r)]

    def _layer_records(self) -> list[dict[str, Any]]:
        return [record for batch in self.batches for record in batch["layer_stats"]]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [
            event
            for batch in self.batches
            for event in batch["events"]
            if kind is None or event["kind"] == kind
        ]

    def column(self, name: str) -> list[Any]:
        values = [record.get(name) for record in self.steps()]
        if name in wire.STEP_FLOAT_FIELDS:
            return [wire.decode_float(v) for v in values]
        return values


def _is_fp8(record: dict[str, Any]) -> bool:
    return all(name.startswith("fp8_") for name in record["stats"])


# --- samples as the training thread hands them to the sender (transport tests) -----------


def step_sample(step: int, loss: float | None = None) -> StepSample:
    """A CPU step sample whose loss is `step` unless given."""
    value = float(step) if loss is None else loss
    return StepSample(step, 0, ("loss",), torch.tensor([value]), None)


def layer_sample(step: int, names: tuple[str, ...] = ("w",), numel: int = 4) -> LayerSample:
    """A sampled step whose every gradient element sits in [1, 2) (exponent field 127)."""
    count = len(names)
    hist = [0.0] * 256
    hist[127] = float(numel)
    values = hist * count + [0.0] * count + [1.0] * count + [65536.0]
    return LayerSample(step, 0, list(names), [numel] * count, torch.tensor(values), None, False)


class FakeClock:
    """A monotonic clock that moves only when told: `DeliveryOptions(clock=c, sleep=c.sleep)`
    with `Sender.tick()` replaces waiting for the sender thread."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def options(self, **options: Any) -> DeliveryOptions:
        """Delivery options on this clock."""
        return DeliveryOptions(clock=self, sleep=self.sleep, **options)


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    """Wait for a condition a background thread makes true, failing after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        time.sleep(0.01)
