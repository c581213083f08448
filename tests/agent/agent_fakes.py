"""Test doubles for the agent: an in-memory collector that decodes what the agent sends."""

from __future__ import annotations

import gzip
import json
from typing import Any

from ampwatch.agent import wire


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
        return [record for batch in self.batches for record in batch["layer_stats"]]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [
            event
            for batch in self.batches
            for event in batch["events"]
            if kind is None or event["kind"] == kind
        ]

    def column(self, name: str) -> list[Any]:
        values = [record[name] for record in self.steps()]
        if name in wire.STEP_FLOAT_FIELDS:
            return [wire.decode_float(v) for v in values]
        return values
