"""API-shaped data for dashboard tests: what the collector's v1 read API answers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

RUN_ID = 7  # the one run the fake collector knows


@pytest.fixture
def run_json() -> dict[str, Any]:
    return {
        "id": RUN_ID,
        "client_run_id": "3f2a",
        "name": "gpt-small",
        "project": "default",
        "status": "running",
        "created_at": "2026-11-29T09:00:00+00:00",
        "last_seen_at": "2026-11-29T09:30:05.123456+00:00",
        "steps": 6,
        "last_step": 6,
        "last_loss_scale": 16384.0,
        "skipped_steps": 2,
    }


@pytest.fixture
def steps_json() -> dict[str, Any]:
    """Six steps: skips at 3 and 5 (the scale halves after each), a NaN loss at 5."""
    return {
        "step": [1, 2, 3, 4, 5, 6],
        "loss": [2.5, 2.4, "Infinity", 2.2, "NaN", 2.0],
        "loss_scale": [65536.0, 65536.0, 65536.0, 32768.0, 32768.0, 16384.0],
        "skipped": [False, False, True, False, True, False],
        "grad_norm": [1.0, 0.9, None, 0.8, None, 0.7],
        "lr": [1e-3] * 6,
        "act_norm_mean": [7.9, 8.0, 8.1, "Infinity", 8.3, 8.4],
        "act_norm_max": [11.2, 11.0, 12.5, 13.0, 40.0, 12.0],
    }


@pytest.fixture
def layers_json() -> dict[str, Any]:
    """Three layers at three sampled steps; `head.weight` frozen (all zero) throughout."""
    return {
        "stat": "zero_fraction",
        "layers": ["embed.weight", "blocks.0.mlp.fc1.weight", "head.weight"],
        "steps": [2, 4, 6],
        "values": [[0.01, 0.1, 1.0], [0.02, "NaN", 1.0], [0.03, 0.3, 1.0]],
    }


@pytest.fixture
def events_json() -> dict[str, Any]:
    return {
        "events": [
            {"kind": "run_start", "step": None, "time": 1.0, "data": {"world_size": 1}},
            {"kind": "checkpoint", "step": 4, "time": 2.0, "data": {"path": "/ckpt/4.pt"}},
        ]
    }


@pytest.fixture
def collector_transport(
    run_json: dict[str, Any],
    steps_json: dict[str, Any],
    layers_json: dict[str, Any],
    events_json: dict[str, Any],
) -> Callable[..., httpx.MockTransport]:
    """A fake collector serving the fixtures for run `RUN_ID`; 404 for anything else."""

    def make(**overrides: Any) -> httpx.MockTransport:
        answers = {
            "/api/v1/runs": {"runs": [run_json]},
            f"/api/v1/runs/{RUN_ID}": run_json,
            f"/api/v1/runs/{RUN_ID}/steps": steps_json,
            f"/api/v1/runs/{RUN_ID}/layers": layers_json,
            f"/api/v1/runs/{RUN_ID}/events": events_json,
            **overrides,
        }

        def handle(request: httpx.Request) -> httpx.Response:
            if request.url.path in answers:
                return httpx.Response(200, content=json.dumps(answers[request.url.path]))
            return httpx.Response(404, json={"detail": "not found"})

        return httpx.MockTransport(handle)

    return make
